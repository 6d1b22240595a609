"""The server panel's memory table: every owner of the three models with its device, and where each model runs."""

from __future__ import annotations

from assistant.device_memory import MemoryRow
from web.stats import MIB, ServerSnapshot


def test_memory_table_lists_owners_by_device_and_the_models_placement() -> None:
    snapshot = ServerSnapshot(
        sessions=1, max_sessions=16, running=0, waiting=0, kv_usage=0.0, kv_blocks_used=0, kv_blocks_total=10,
        prefix_queries=0, prefix_hits=0, preemptions=0, devices={"llm": "cuda", "asr": "cuda", "tts": "cpu"},
        memory=(MemoryRow("llm weights", "cuda", 16 * 1024 * MIB), MemoryRow("asr buffers", "cuda", 512 * MIB)),
        process_rss=100 * MIB, recent=(),
    )  # fmt: skip
    text = snapshot.markdown()
    assert "**Memory** (LLM on cuda, ASR on cuda, TTS on cpu)" in text
    assert "| llm weights | cuda | 16,384.0 |" in text and "| asr buffers | cuda | 512.0 |" in text
    assert "| this process (resident, all models) | cpu | 100.0 |" in text
