"""The chunked suite: inter-token latency of running streams while a long prompt is prefilled."""

from __future__ import annotations

import random

from engine.bench.report import Row
from engine.bench.workload import Sizes, random_prompt
from engine.engine_core import EngineCore
from engine.sampling import SamplingParams


def bench_chunked(core: EngineCore, sizes: Sizes, rng: random.Random, results: dict) -> list[Row]:
    """ITL of running streams while a long prompt arrives, with chunked prefill on and off.

    Each run's baseline is the same streams decoding for as many steps without the long prompt:
    the streams' own contexts grow as they decode (by ~1,000 tokens over a prompt chunked 32
    tokens a step), which costs decode attention with or without the prompt."""
    vocab = core.model_config.vocab_size
    cfg = core.scheduler.config
    saved = (cfg.enable_chunked_prefill, cfg.max_num_batched_tokens)
    rows = []

    def phase(long_prompt: bool, chunked: bool, budget: int, steps: int = 0) -> tuple[float, float, float | None, int]:
        """(ITL p50, ITL p99, the long prompt's TTFT, steps) of one run; without the long prompt
        the streams decode for ``steps`` steps."""
        cfg.enable_chunked_prefill, cfg.max_num_batched_tokens = chunked, budget
        core.block_manager.reset_prefix_cache()
        streams = [core.add_request(random_prompt(rng, 64, vocab), SamplingParams(max_tokens=100_000, ignore_eos=True))
                   for _ in range(sizes.chunked_streams)]
        while any(len(r.output_token_ids) < 3 for r in streams):
            core.step()
        start = [len(r.metrics.token_times) for r in streams]
        long_req = None
        taken = 0
        if long_prompt:
            long_req = core.add_request(random_prompt(rng, sizes.chunked_long, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
            while long_req.metrics.first_token_time is None:
                core.step()
                taken += 1
        else:
            for _ in range(steps):
                core.step()
                taken += 1
        for _ in range(3):
            core.step()
        # from the gap that ends with the first token after the long prompt arrived
        itl = [g for r, s in zip(streams, start) for g in r.metrics.inter_token_latencies[s - 1 :]]
        for r in streams:
            core.abort_request(r.request_id)
        if long_req is not None and not long_req.status.finished:
            core.abort_request(long_req.request_id)
        itl.sort()
        p99 = itl[min(len(itl) - 1, int(0.99 * len(itl)))]
        return itl[len(itl) // 2], p99, long_req.metrics.ttft if long_req is not None else None, taken

    def with_base(chunked: bool, budget: int) -> tuple[float, float, float, float, float, tuple[int, int]]:
        """(ITL p50, p99, TTFT, baseline p50, baseline p99, (steps, baseline steps)) for one setting."""
        p50, p99, ttft, steps = phase(True, chunked, budget)
        base_p50, base_p99, _, base_steps = phase(False, True, budget, steps)
        return p50, p99, ttft, base_p50, base_p99, (steps, base_steps)

    headline = sizes.chunked_budgets[0]
    by_budget = {b: with_base(True, b) for b in sizes.chunked_budgets}
    _, no_chunk, ttft_whole, _, no_chunk_base, _ = with_base(False, headline)
    cfg.enable_chunked_prefill, cfg.max_num_batched_tokens = saved
    _, with_chunk, ttft_chunk, base_p50, base, _ = by_budget[headline]
    results.update(chunked_itl_p99_ratio=with_chunk / base, unchunked_itl_p99_ratio=no_chunk / no_chunk_base,
                   long_prompt_ttft_chunked_ms=ttft_chunk * 1e3, long_prompt_ttft_unchunked_ms=ttft_whole * 1e3,
                   chunked_headline_budget=headline, chunked_itl_base_ms={"p50": base_p50 * 1e3, "p99": base * 1e3},
                   chunked_by_budget={str(b): {"itl_p99_ratio": p / bp, "itl_p50_ms": m * 1e3, "itl_p99_ms": p * 1e3,
                                               "base_itl_p50_ms": bm * 1e3, "base_itl_p99_ms": bp * 1e3, "long_prompt_ttft_ms": t * 1e3,
                                               "steps": n[0], "base_steps": n[1]}
                                      for b, (m, p, t, bm, bp, n) in by_budget.items()})
    label = f"{sizes.chunked_streams} streams, {sizes.chunked_long}-token prompt arrives"
    for b, (_, p99, ttft, _, bp, _) in by_budget.items():
        rows.append(Row(f"ITL p99, {label}, chunked ({b}/step)", p99 * 1e3, "ms", "same steps without the long prompt", bp * 1e3, False))
        rows.append(Row(f"long prompt TTFT, chunked ({b}/step)", ttft * 1e3, "ms", "not chunked", ttft_whole * 1e3, False))
    rows.append(Row(f"ITL p99, {label}, not chunked", no_chunk * 1e3, "ms", "same steps without the long prompt", no_chunk_base * 1e3, False))
    return rows
