"""The KV budget at start-up: a budget too small for one full-length sequence is a clear error
that names the numbers (budget, blocks, tokens, what to change), not a server that fails later."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.config import ConfigError


def test_a_budget_short_of_one_sequence_is_a_start_up_error_naming_the_numbers(tiny_llama_dir):
    # The tiny model: 3 layers x 2 KV heads x 12 dims x K and V x fp32 = 576 bytes a token, 9,216 a 16-token block.
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_llama_dir), kv_cache_memory_bytes=100_000, block_size=16)
    message = str(err.value)
    for part in ("does not fit one 512-token sequence", "kv_cache_memory_bytes as configured", "10 blocks of 16 tokens",
                 "= 160 tokens", "lower max_model_len"):
        assert part in message, message
    llm = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=100_000, block_size=16, max_model_len=160)  # it fits exactly
    assert llm.stats().kv_blocks_total == 9  # one of the 10 is the engine's null block
