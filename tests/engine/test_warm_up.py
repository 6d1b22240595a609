"""The start-up warm-up (EngineConfig.warm_up): real steps through the engine's own loop, after
which the engine looks untouched. On the CPU it is off by default (nothing to compile); "on"
runs it here, so its bookkeeping is tested where CI runs. The GPU bench shows what it buys
(the first prefill's Triton compiles move from the first request to start-up)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError


def test_the_warm_up_runs_real_steps_and_leaves_no_trace(tiny_llama_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = LLM(str(tiny_llama_dir), num_kv_blocks=96, block_size=4, warm_up="auto")  # auto: off on the CPU
    warm = LLM(str(tiny_llama_dir), num_kv_blocks=96, block_size=4, warm_up="on")
    assert cold.core.warm_up_steps == 0
    assert warm.core.warm_up_steps >= 8  # four requests: a prefill and a decode step each at least
    stats = warm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total  # every warm-up block back in the pool
    assert (stats.prompt_tokens, stats.generation_tokens, stats.prefix_cache_queries, stats.num_preemptions) == (0, 0, 0, 0)
    assert len(warm.core.block_manager.prefix_cache) == 0 and warm.core.step_times.steps == 0 and warm.core.num_steps == 0
    assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in cold.generate(prompts, params)]
    assert warm.core.add_request([1, 2, 3]).request_id == cold.core.add_request([1, 2, 3]).request_id


def test_an_unknown_warm_up_setting_is_a_config_error(tiny_llama_dir):
    with pytest.raises(ConfigError, match="warm_up must be auto/on/off"):
        LLM(str(tiny_llama_dir), num_kv_blocks=96, warm_up="yes")
