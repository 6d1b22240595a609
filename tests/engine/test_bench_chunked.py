"""The chunked-prefill benchmark's bookkeeping, on a tiny random model on the CPU (the figures
themselves are for the GPU; here: what is compared with what)."""

from __future__ import annotations

import dataclasses
import random

import torch

from engine import EngineConfig, build_engine
from engine.bench.chunked import bench_chunked
from engine.bench.workload import Sizes


def test_each_budget_is_compared_with_as_many_steps_without_the_long_prompt(tiny_llama_dir):
    core = build_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=256, max_model_len=400))
    sizes = dataclasses.replace(Sizes.for_device(torch.device("cpu")), chunked_streams=2, chunked_long=60, chunked_budgets=(16, 8))
    results: dict = {}
    rows = bench_chunked(core, sizes, random.Random(0), results)
    by = results["chunked_by_budget"]
    assert results["chunked_headline_budget"] == 16
    assert by["8"]["steps"] > by["16"]["steps"] >= 60 // (16 - 2)  # smaller chunks: more steps (2 streams take 2 tokens a step)
    for b in ("16", "8"):
        assert by[b]["base_steps"] == by[b]["steps"]
        assert by[b]["itl_p99_ratio"] == by[b]["itl_p99_ms"] / by[b]["base_itl_p99_ms"]
    assert results["chunked_itl_p99_ratio"] == by["16"]["itl_p99_ratio"]
    assert results["chunked_itl_base_ms"]["p99"] == by["16"]["base_itl_p99_ms"]
    assert results["long_prompt_ttft_unchunked_ms"] > 0 and results["unchunked_itl_p99_ratio"] > 0
    assert rows[-1].figure.endswith("not chunked") and len(rows) == 2 * 2 + 1
    assert rows[0].reference == "same steps without the long prompt" and rows[0].ref_value == by["16"]["base_itl_p99_ms"]
    assert core.scheduler.config.max_num_batched_tokens == EngineConfig.max_num_batched_tokens  # settings restored
    stats = core.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not core.has_unfinished_requests()
