"""A KV cache budget too small for two blocks stops the start-up with the numbers in the message."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.engine_builder import build_engine


def test_a_kv_budget_below_two_blocks_names_the_sizes(tiny_llama_dir) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory_bytes=1000)
    with pytest.raises(ConfigError, match=r"needs at least 2 blocks of 16 tokens \([\d.]+ MiB\), but its budget is 0\.0 MiB: "
                                          "raise kv_cache_memory_bytes"):  # fmt: skip
        build_engine(config)
