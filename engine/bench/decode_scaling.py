"""The decode-scaling suite: aggregate output tok/s of 1, 8, 9, 16 and 32 concurrent streams.

Each run starts ``n`` streams on random prompts, steps until every one has its first token (the
prefills are done), then times the steps during which all ``n`` decode together: the aggregate
rate is ``n`` tokens a step over those steps' time. Batch 1 of the same run is the baseline, so a
cliff (a batch size that falls off the fast decode path) shows as a ratio below the one before it.
With the native CPU decode step, 8 and 9 streams also run once through the PyTorch path, the way
batches above 8 ran before the native step covered every batch size.
"""

from __future__ import annotations

import random
import sys
import time

from engine.bench.report import Row
from engine.bench.workload import Sizes, random_prompt, run_to_completion
from engine.engine_core import EngineCore
from engine.sampling import SamplingParams

STREAMS = (1, 8, 9, 16, 32)
PYTORCH_STREAMS = (8, 9)  # the native step's old limit and one past it, through PyTorch


def decode_rate(core: EngineCore, n: int, sizes: Sizes, rng: random.Random) -> float:
    """Aggregate output tok/s while ``n`` streams decode together (prefills excluded)."""
    core.block_manager.reset_prefix_cache()
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=sizes.scaling_out, ignore_eos=True)
    reqs = [core.add_request(random_prompt(rng, sizes.scaling_prompt, vocab), params) for _ in range(n)]
    while any(r.num_output_tokens == 0 for r in reqs):
        core.step()
    steps, t = 0, time.perf_counter()
    while steps < sizes.scaling_steps and not any(r.status.finished for r in reqs):
        core.step()
        steps += 1
    seconds = time.perf_counter() - t
    run_to_completion(core)
    return n * steps / seconds


def bench_decode_scaling(core: EngineCore, sizes: Sizes, rng: random.Random, results: dict) -> list[Row]:
    """Aggregate decode tok/s at each of :data:`STREAMS` against batch 1, and where the engine has
    the native CPU step, :data:`PYTORCH_STREAMS` through PyTorch too."""
    if core.config.max_num_seqs < max(STREAMS):
        raise ValueError(f"decode-scaling runs {max(STREAMS)} streams: --max-num-seqs must be at least that")
    decode_rate(core, 2, sizes, rng)  # warm-up
    rates = {}
    for n in STREAMS:
        rates[n] = decode_rate(core, n, sizes, rng)
        print(f"    {n} streams: {rates[n]:.1f} out tok/s", file=sys.stderr, flush=True)
    rows = [Row(f"decode, {n} streams at once (prompt {sizes.scaling_prompt}), aggregate", rates[n], "out tok/s", "batch 1", rates[1])
            for n in STREAMS]
    results.update({f"decode_scaling_{n}_tok_s": rates[n] for n in STREAMS})
    native = core.runner.native
    if native is not None:
        core.runner.native = None
        try:
            for n in PYTORCH_STREAMS:
                torch_rate = decode_rate(core, n, sizes, rng)
                rows.append(Row(f"decode, {n} streams at once, native step", rates[n], "out tok/s", "same through PyTorch", torch_rate))
                results[f"decode_scaling_{n}_pytorch_tok_s"] = torch_rate
        finally:
            core.runner.native = native
    return rows
