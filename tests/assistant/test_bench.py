"""``python -m assistant.bench``: a short real run (its own server, real models) to JSON and PNG."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from assistant.config import HANDBOOK_DIR
from assistant.timeline import OPTIONAL_STAGES, STAGES

HANDS_FREE = [s for s in STAGES if s not in OPTIONAL_STAGES]  # the bench's callers never send response.create
from tests.conftest import REPO


def bench(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assistant.bench", "--no-progress", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip


def test_bench_measures_every_stage_for_one_and_two_callers(tmp_path, whisper_tiny_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    out, png = tmp_path / "bench.json", tmp_path / "waterfall.png"
    r = bench("--callers", "1", "2", "--turns", "1", "--docs", str(docs), "--asr", str(whisper_tiny_path), "--lang", "en",
              "--max-output-tokens", "8", "--json", str(out), "--plot", str(png))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| server: speech_end -> first audio sent |" in r.stdout and "| client: end of speech -> first audio received |" in r.stdout
    assert "| false endpoints: questions with a pause / spoken whole | 0 of 0 / 0 of 1 |" in r.stdout
    report = json.loads(out.read_text())
    assert report["meta"]["versions"]["faster-whisper"] and report["meta"]["cores"] >= 1 and report["meta"]["date"]
    assert [p["callers"] for p in report["phases"]] == [1, 2]
    for phase in report["phases"]:
        assert len(phase["turns"]) == phase["callers"]
        for turn in phase["turns"]:
            assert turn["error"] is None and turn["status"] in ("completed", "incomplete")
            assert list(turn["timeline"]["instants_ms"]) == HANDS_FREE
            assert turn["wer"] <= 0.25 and turn["client_s2a_ms"] > turn["client_s2a_minus_hangover_ms"] > 0
        assert phase["false_endpoints"]["whole"]["n"] == phase["callers"] and phase["false_endpoints"]["paused"]["n"] == 0
        summary = phase["summary"]
        for key in (*HANDS_FREE[1:], "speech_end_to_first_audio", "endpoint_to_first_audio", "client_s2a", "client_s2a_minus_hangover"):
            assert summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"] and summary[key]["n"] == phase["callers"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_without_a_server_fails_with_a_message() -> None:
    r = bench("--url", "ws://127.0.0.1:9/v1/realtime", "--callers", "1", "--turns", "1", timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error:")
    assert "Traceback" not in r.stderr


def test_paused_questions_have_the_pause_they_say() -> None:
    """Each question's halves are joined by its pause exactly: the silence between its two runs
    of speech (by the same -40 dB envelope) is the pause, and the question ends at its speech end."""
    import numpy as np

    from assistant.bench import RATE, speak_paused, speech_bounds

    texts = ("How do I apply for annual leave?", "How long is the probation period?")
    for q, pause in zip(speak_paused(texts, (300, 700)), (300, 700), strict=True):
        audio = np.frombuffer(q.pcm, "<i2").astype(np.float32) / 32768
        envelope = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(RATE // 100) / (RATE // 100), "same"))
        quiet = envelope <= envelope.max() * 0.01
        start, end = speech_bounds(audio)
        runs = np.flatnonzero(np.diff(quiet[round(start * RATE) : round(end * RATE)].astype(int)))
        longest = max((b - a for a, b in zip(runs[::2], runs[1::2])), default=0) / RATE
        assert q.pause_ms == pause and abs(longest - pause / 1000) <= 0.03, (q.text, longest)
        assert q.speech_end_s == len(audio) / RATE
