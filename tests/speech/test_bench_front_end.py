"""The front-end cost benchmark: its figures add up, and Silero's ONNX time is counted apart."""

from __future__ import annotations

import json

from speech.bench_front_end import main


def test_front_end_bench_reports_gil_held_time_and_its_ceiling(tmp_path, capsys) -> None:
    out = tmp_path / "front_end.json"
    assert main(["--seconds", "2", "--chunk-ms", "20", "--json", str(out)]) == 0
    silero, baseline = json.loads(out.read_text())["results"]
    assert silero["packets"] == baseline["packets"] == 100
    assert silero["onnx_us"] > 0 and baseline["onnx_us"] == 0  # only the Silero variant runs ONNX
    for r in (silero, baseline):
        assert abs(r["gil_us"] - (r["resample_us"] + r["vad_us"] - r["onnx_us"])) < 0.5
        assert abs(r["callers_per_gil"] - 20_000 / r["gil_us"]) < 0.5
    assert "callers per GIL" in capsys.readouterr().out
