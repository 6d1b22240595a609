"""The benchmarks' workloads: their sizes per device, random prompts, and requests run to completion."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.engine_core import EngineCore
from engine.sampling import SamplingParams


@dataclass
class Sizes:
    """Workload sizes; CPU defaults are small enough for a 2-core machine."""

    decode_prompt: int
    decode_tokens: int
    prefill_batch: int
    prefill_len: int
    throughput_requests: int
    throughput_in: tuple[int, int]
    throughput_out: tuple[int, int]
    prefix_len: int
    question_len: int
    prefix_runs: int
    chunked_streams: int
    chunked_long: int
    chunked_budgets: tuple[int, ...]  # the first is the headline; the others show the ITL / TTFT trade-off
    # The engine of every suite but throughput; it leaves room for the HF baseline.
    max_num_seqs: int
    max_num_batched_tokens: int
    # The throughput suite's own engine, built after the HF baseline and the first engine are
    # released: a serving-scale batch (vLLM's offline defaults on an H100/H200) and KV pool.
    throughput_max_num_seqs: int
    throughput_max_num_batched_tokens: int
    throughput_gpu_memory_utilization: float
    # The decode-scaling suite: prompt tokens of each stream, its output tokens (room for the
    # first streams' tokens during the others' prefills) and the steps timed with all decoding.
    scaling_prompt: int = 256
    scaling_out: int = 64
    scaling_steps: int = 16

    @classmethod
    def for_device(cls, device: torch.device) -> "Sizes":
        if device.type == "cuda":
            # 2026-11-30 H200 (docs/performance.md): the throughput run at max_num_seqs 256 /
            # 8,192 tokens a step: 9,326 out tok/s; 512 / 16,384: 10,002; 1,024 / 16,384: 10,241
            # (all at 0.9 of the memory: the last 256 requests' tail is shorter in a wider batch).
            return cls(512, 128, 8, 2048, 1000, (128, 1024), (128, 512), 32000, 30, 10, 32, 32000, (64, 128, 256, 512),
                       256, 8192, 1024, 16384, 0.9)
        return cls(128, 48, 2, 256, 32, (64, 192), (32, 64), 2000, 30, 5, 8, 1500, (64, 32), 32, 512, 32, 512, 0.9)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` random token ids (clear of the special tokens at the ends of the vocabulary)."""
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def run_to_completion(core: EngineCore) -> None:
    """Step the engine until every request has finished."""
    while core.has_unfinished_requests():
        core.step()


def engine_decode(core: EngineCore, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(ttft s, tpot s) of one request alone."""
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.ttft, req.metrics.tpot
