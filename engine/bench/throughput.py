"""The throughput suite: many requests at once against the roofline, the no-overlap bound and HF,
on an engine of its own when its batch limits differ from the other suites'.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from engine.bench.ceilings import decode_step_bytes, throughput_bounds
from engine.bench.report import Row, slowest_steps
from engine.bench.workload import Sizes, random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes
from engine.sampling import SamplingParams


def bench_throughput(core: EngineCore, sizes: Sizes, rng: random.Random, results: dict, bw: float, flops: float,
                     projection_flops: float | None = None) -> list[Row]:
    """Many requests at once (after a warm-up on a fifth of them) against the roofline, the no-overlap bound and HF."""
    vocab = core.model_config.vocab_size

    def run(n: int) -> tuple[list, float]:
        core.block_manager.reset_prefix_cache()
        reqs = []
        t = time.perf_counter()
        for _ in range(n):
            prompt = random_prompt(rng, rng.randint(*sizes.throughput_in), vocab)
            out_len = rng.randint(*sizes.throughput_out)
            reqs.append(core.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)))
        run_to_completion(core)
        return reqs, time.perf_counter() - t

    # Warm-up on a fifth of the workload: the attention kernels' Triton specializations for its
    # step shapes compile here, not inside the timed run (on a fresh H200 lease they cost 1.4-2.7
    # s each, ~9 s of a ~36 s run: 7.1k vs 8.9k out tok/s, docs/performance.md).
    run(max(1, sizes.throughput_requests // 5))
    print(f"    warm-up's {slowest_steps(core.step_times)}", file=sys.stderr)
    core.step_times = StepTimes()
    reqs, seconds = run(sizes.throughput_requests)
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    tput = out_tokens / seconds
    decode_rate = core.step_times.decode_rate
    bounds = throughput_bounds(core.model_config, [(r.num_prompt_tokens, len(r.output_token_ids)) for r in reqs],
                               core.step_times.steps, decode_step_bytes(core, 0), core.kv_cache.spec.bytes_per_token, flops, bw,
                               projection_flops)
    results.update(throughput_output_tok_s=tput, throughput_requests=len(reqs), throughput_decode_phase_tok_s=decode_rate,
                   throughput_roofline_tok_s=out_tokens / bounds.roofline_s, throughput_serial_bound_tok_s=out_tokens / bounds.serial_s,
                   throughput_compute_s=bounds.compute_s, throughput_memory_s=bounds.memory_s)
    ref = results.get("hf_decode_bs1_tok_s")
    label = "HF generate() batch 1" if ref else ""
    name = f"throughput, {len(reqs)} requests at once (whole run, prefill included)"
    return [Row(name, tput, "out tok/s", label, ref),
            Row(name, tput, "out tok/s", f"roofline: {bounds.compute_s:.2f} s FLOPs, {bounds.memory_s:.2f} s bytes, overlapped",
                out_tokens / bounds.roofline_s),
            Row(name, tput, "out tok/s", "the same one after the other (no overlap)", out_tokens / bounds.serial_s),
            Row(f"throughput, {len(reqs)} requests, decode-only steps", decode_rate, "out tok/s", label, ref)]


def same_engine(a: EngineConfig, b: EngineConfig, device: torch.device) -> bool:
    """Whether the throughput suite can run on the first engine: same batch limits, and off
    CUDA the memory fraction is not read (the CPU pool has a fixed size)."""
    return (a.max_num_seqs, a.max_num_batched_tokens) == (b.max_num_seqs, b.max_num_batched_tokens) and (
        device.type != "cuda" or a.gpu_memory_utilization == b.gpu_memory_utilization)


def throughput_engine(config: EngineConfig, loaded: LoadedModel) -> EngineCore:
    """A second engine on the same weights for the throughput suite, after the first one's KV
    pool and graphs are freed (its memory then goes to this one's pool)."""
    import gc

    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(loaded.device)
    core = build_engine(config, loaded)
    print(f"# throughput engine: max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
          f"gpu_memory_utilization {config.gpu_memory_utilization}: {core.kv_cache.num_blocks:,} KV blocks", flush=True)
    return core
