"""``python -m assistant.bench``: a short real run (its own server, real models) to JSON and PNG."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from assistant.config import HANDBOOK_DIR
from assistant.bench_report import BREAKDOWN
from assistant.timeline import OPTIONAL_STAGES, STAGES

HANDS_FREE = [s for s in STAGES if s not in OPTIONAL_STAGES]  # the bench's callers never send response.create
from tests.conftest import REPO


def bench(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assistant.bench", "--no-progress", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip


def test_bench_measures_every_stage_for_two_conversing_callers_and_a_burst_then_again_with_the_coscheduler_off(tmp_path, whisper_tiny_path) -> None:
    """Two callers, two questions each with a pause between, then both at once: every stage, the
    results object (p50/p95/p99 per caller count, lost turns, memory by owner), JSON and PNG. Then
    (--ab) the same two callers against a second server started with the co-scheduler off, whose
    log --server-log keeps beside the first's. (One bench run for both: each run starts its own
    server, about 25 s on a 2-core machine.) Fixed endpointing, so every turn's stages come in the
    order HANDS_FREE lists them (a speculative answer's may come before its endpoint)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    out, png = tmp_path / "bench.json", tmp_path / "waterfall.png"
    r = bench("--callers", "2", "--ab", "2", "--turns", "2", "--pause-s", "0.2", "0.4", "--pause-ms", "300", "--burst", "--docs", str(docs),
              "--asr", str(whisper_tiny_path), "--lang", "en", "--max-output-tokens", "8", "--tts-workers", "1", "--json", str(out),
              "--plot", str(png), "--server-log", str(tmp_path / "logs"), "--endpointing", "fixed")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| server: speech_end -> first audio sent |" in r.stdout and "| client: end of speech -> first audio received |" in r.stdout
    assert "2 caller(s), burst p50 / p95 / p99" in r.stdout and "2 caller(s), coscheduler off p50 / p95 / p99" in r.stdout
    assert "| false endpoints: questions with a pause / spoken whole | 0 of 2 / 0 of 2 | 0 of 0 / 0 of 2 | 0 of 2 / 0 of 2 |" in r.stdout
    report = json.loads(out.read_text())
    assert report["date"] and "--burst" in report["command"] and "gpu" in report
    assert report["meta"]["versions"]["faster-whisper"] and report["meta"]["cores"] >= 1
    assert [(p["callers"], p["pattern"], p["server"], len(p["turns"])) for p in report["phases"]] == [
        (2, "conversation", "", 4), (2, "burst", "", 2), (2, "conversation", "coscheduler off", 4)]  # fmt: skip
    for phase in report["phases"]:
        for turn in phase["turns"]:
            assert turn["error"] is None and turn["status"] in ("completed", "incomplete")
            assert list(turn["timeline"]["instants_ms"]) == HANDS_FREE
            assert turn["wer"] <= 0.25 and turn["client_s2a_ms"] > turn["client_s2a_minus_hangover_ms"] > 0
        paused = [t for t in phase["turns"] if t["pause_ms"] is not None]  # every second turn of a conversation
        assert [t["turn"] for t in paused] == ([1, 1] if phase["pattern"] == "conversation" else [])
        assert phase["false_endpoints"]["paused"] == {"false": 0, "n": len(paused), "rate": 0.0 if paused else None}
        summary = phase["summary"]
        for key in (*HANDS_FREE[1:], "speech_end_to_first_audio", "endpoint_to_first_audio", "client_s2a", "client_s2a_minus_hangover"):
            assert summary[key]["p50"] <= summary[key]["p95"] <= summary[key]["p99"] and summary[key]["n"] == len(phase["turns"])
    results = report["results"]
    assert results["config"] == "custom" and results["pattern"]["pause_s"] == [0.2, 0.4] and results["pattern"]["turns"] == 2
    assert set(results["callers"]) == set(results["burst"]) == set(results["coscheduler_off"]) == {"2"}
    two = results["callers"]["2"]
    assert (two["turns"], two["lost_turns"]) == (4, 0)
    for key in ("endpoint_to_first_audio_ms", "speech_end_to_first_audio_ms", "client_speech_end_to_first_audio_ms"):
        assert set(two[key]) == {"p50", "p95", "p99"} and two[key]["p50"] <= two[key]["p99"]
    assert set(two["stages"]) == set(HANDS_FREE[1:]) and all(set(v) == {"p50", "p95", "p99"} for v in two["stages"].values())
    assert set(two["breakdown"]) == set(BREAKDOWN) and "| - of which (ASR): waiting in the ASR worker's queue |" in r.stdout
    assert two["event_loop_lag_ms"]["n"] > 0 and "| server event loop lag, 20 ms timer (bucket bound) |" in r.stdout
    assert two["gil_wait_ms"]["n"] > 0 and "| server GIL wait after a 5 ms sleep (bucket bound) |" in r.stdout
    assert two["memory_bytes"]["cpu"]["llm weights"] > 0 and two["memory_bytes"]["cpu"]["llm kv_cache"] > 0
    steps = two["engine_steps"]  # the engine's step counters over the phase: busy, not always (callers speak), no GPU
    assert 0 < steps["host_busy"] < 1 and steps["device_busy"] is None and steps["by_mode"]
    assert all(m["steps"] > 0 and m["host_ms"] > 0 and m["tokens"] >= 1 and m["device_ms"] is None for m in steps["by_mode"].values())
    assert "| engine busy in steps: its thread / the GPU (share of the phase) |" in r.stdout and "| engine steps (" in r.stdout
    conversation = report["phases"][0]["turns"]
    assert sorted((t["caller"], t["turn"]) for t in conversation) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    off = results["coscheduler_off"]["2"]
    assert (off["turns"], off["lost_turns"]) == (4, 0) and off["endpoint_to_first_audio_ms"]["p50"] > 0
    logs = sorted((tmp_path / "logs").glob("assistant-serve-*.log"))  # --server-log keeps both servers' logs
    assert len(logs) == 2 and all("Traceback" not in log.read_text() for log in logs)


def test_bench_options_become_server_arguments() -> None:
    """Presets, named pass-through options and --server-arg reach the server in that order; the A/B
    counts and the session limit follow the callers."""
    from assistant.bench import COSCHEDULER_OFF, parse_args

    cfg = parse_args(["--config", "8b", "--callers", "1,8", "32", "--ab", "32", "--asr-device", "cuda", "--coscheduler", "on",
                      "--server-arg=--early-prefill", "--duration-s", "60"])  # fmt: skip
    assert cfg.callers == (1, 8, 32) and cfg.ab == (32,) and cfg.config_name == "8b" and cfg.pattern.duration_s == 60
    args = cfg.server_args
    assert args[:4] == ("--model", args[1], "--load-format", "dummy") and args[1].endswith("engine/configs/llama-3.1-8b.json")
    assert args[args.index("--coscheduler") + 1] == "on" and "--early-prefill" in args
    assert "--no-refusal-gate" in args  # random-weight transcripts must reach the LLM, not the gate's refusal
    assert args[-2:] == ("--max-sessions", "32") and COSCHEDULER_OFF == ("--coscheduler", "off")
    given = len(args) - 1 - args[::-1].index("--asr-device")
    assert given > args.index("--tts-backend")  # given options come after the preset's, so they win


def test_bench_without_a_server_fails_with_a_message() -> None:
    r = bench("--url", "ws://127.0.0.1:9/v1/realtime", "--callers", "1", "--turns", "1", timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error:")
    assert "Traceback" not in r.stderr


def test_paused_questions_have_the_pause_they_say() -> None:
    """Each question's halves are joined by its pause exactly: the silence between its two runs
    of speech (by the same -40 dB envelope) is the pause, and the question ends at its speech end."""
    import numpy as np

    from assistant.bench_callers import RATE, speak_paused, speech_bounds

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


def test_a_refused_caller_is_a_lost_turn_with_the_reason(tmp_path, whisper_tiny_path) -> None:
    """A caller the server turns away (its session limit) counts as a lost turn that says why; the
    other caller's turn is measured and the run exits 1. The two callers run in two client
    processes, whose results come back together."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    out = tmp_path / "bench.json"
    r = bench("--callers", "2", "--turns", "1", "--max-sessions", "1", "--docs", str(docs), "--asr", str(whisper_tiny_path),
              "--lang", "en", "--max-output-tokens", "8", "--tts-workers", "1", "--client-processes", "2", "--json", str(out))  # fmt: skip
    assert r.returncode == 1 and "1 turn(s) lost" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    turns = json.loads(out.read_text())["phases"][0]["turns"]
    refused = [t for t in turns if t["error"]]
    assert len(turns) == 2 and len(refused) == 1 and refused[0]["error"].startswith("refused:")
    assert sorted(t["caller"] for t in turns) == [0, 1] and len({t["client_pid"] for t in turns}) == 2  # one process each
    assert "session_limit_reached" in refused[0]["error"]
