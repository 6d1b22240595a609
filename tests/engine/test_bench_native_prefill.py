"""``python -m engine.bench native-prefill``: the tiled step against its baselines, on the embedded SmolLM2."""

from __future__ import annotations

from engine.bench.cli import main
from engine.config import default_cache_dir
from engine.native_decode import build_library


def test_native_prefill_prints_each_chunk_against_its_ceiling_and_baselines(llm_gguf_path, capsys) -> None:
    assert main(["native-prefill", "--model", str(llm_gguf_path), "--context", "40", "--tokens", "1", "9", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for t in (1, 9):
        assert f"T={t} after 40 cached, tiled " in out and f"T={t} after 40 cached, tiled vs per-row" in out
        assert f"T={t}    tiled   step" in out  # the breakdown: the step at position 0 against after the context
    # The 256-bit tile is a baseline of its own only where this CPU builds the AVX-512 one.
    wide = build_library(default_cache_dir()).simd_level() == 3
    assert ("AVX-512 VNNI tile vs 256-bit" in out) == wide
    assert "matrices at int8 GEMM rate / weight read" in out and "copy bandwidth" in out
