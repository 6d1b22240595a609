"""The prefix suite: time to first token after a cached prefix, against the same prompt uncached."""

from __future__ import annotations

import random
import statistics

from engine.bench.report import Row
from engine.bench.workload import Sizes, random_prompt, run_to_completion
from engine.engine_core import EngineCore
from engine.sampling import SamplingParams


def bench_prefix(core: EngineCore, sizes: Sizes, rng: random.Random, results: dict) -> list[Row]:
    """TTFT of a question after a cached long prefix against the same with the prefix not cached."""
    vocab = core.model_config.vocab_size
    prefix = random_prompt(rng, sizes.prefix_len, vocab)

    def ttft(question):
        req = core.add_request(prefix + question, SamplingParams(max_tokens=1, ignore_eos=True))
        run_to_completion(core)
        return req.metrics.ttft

    core.block_manager.reset_prefix_cache()
    ttft(random_prompt(rng, sizes.question_len, vocab))  # warm: the prefix is now cached
    cached = [ttft(random_prompt(rng, sizes.question_len, vocab)) for _ in range(sizes.prefix_runs)]
    uncached = []
    for _ in range(max(2, sizes.prefix_runs // 2)):
        core.block_manager.reset_prefix_cache()
        uncached.append(ttft(random_prompt(rng, sizes.question_len, vocab)))
    c50, u50 = statistics.median(cached) * 1e3, statistics.median(uncached) * 1e3
    results.update(prefix_ttft_p50_ms=c50, uncached_ttft_p50_ms=u50)
    return [Row(f"TTFT, {sizes.question_len}-token question after a cached {sizes.prefix_len}-token prefix", c50, "ms p50",
                "same question, prefix not cached", u50, higher_is_better=False)]
