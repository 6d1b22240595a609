"""The KV budget at start-up: a budget too small for one full-length sequence is a clear error
that names the numbers (budget, blocks, tokens, what to change), not a server that fails later."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import ConfigError
from engine.engine_builder import CPU_DEFAULT_KV_BYTES, cpu_default_kv_budget
from engine.kv_cache import KVCacheSpec
from engine.profiling import KVBudget


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


def test_the_cpu_default_grows_to_hold_one_full_length_sequence_of_a_wide_float32_model():
    # The 1.5B's shape in float32 (quantization='none' on the CPU): 28 layers x 2 KV heads x 128 dims
    # x K and V x 4 bytes = 57,344 bytes a token; 1 GiB holds 18,724 tokens, short of its 32,768.
    wide = KVCacheSpec(num_layers=28, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.float32)
    budget = cpu_default_kv_budget(wide, 32_768)
    assert wide.num_blocks_for_budget(budget.nbytes) * 16 >= 32_768 + 16  # the sequence and the null block
    assert "raised to one 32768-token sequence" in budget.explanation
    # a model whose sequence fits keeps the plain 1 GiB
    small = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=12, block_size=16, dtype=torch.float32)
    assert cpu_default_kv_budget(small, 512) == KVBudget(CPU_DEFAULT_KV_BYTES, "the CPU default")
