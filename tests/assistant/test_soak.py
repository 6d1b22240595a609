"""``python -m assistant.soak``: a short run against its own real server (five clients: each starts at
another of the five episodes, so every kind of fault comes up at once), and the verdict's rules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from assistant.config import HANDBOOK_DIR
from assistant.soak import SoakConfig, report, text_report, tracebacks
from assistant.soak_callers import Tally
from tests.conftest import REPO

QUESTIONS = ("How do I apply for annual leave?", "How many days of annual leave do I get per year?",
             "Can I carry over unused annual leave?")  # fmt: skip


def test_a_short_soak_mixes_turns_and_faults_and_leaves_the_server_clean(tmp_path, whisper_tiny_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(QUESTIONS))
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "assistant.soak", "--sessions", "5", "--minutes", "0.2", "--warm-up-minutes", "0.02", "--progress", "5",
         "--max-output-tokens", "16", "--questions", str(questions), "--json", str(out),
         "--docs", str(docs), "--lang", "en", "--asr", str(whisper_tiny_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "PASS" and "(after warm-up)" in r.stdout and "(all clients gone)" in r.stdout
    rep = json.loads(out.read_text())
    turns = rep["turns"]
    assert turns["completed"] > 0 and turns["lost"] == 0 and turns["attempted"] == sum(turns[k] for k in ("completed", "cancelled", "unheard", "lost"))
    assert rep["faults_injected"] > 0 and rep["faults_injected"] == sum(rep["faults"].values())
    assert rep["garbage"]["answered_with_error"] == rep["garbage"]["sent"]
    assert rep["after_clients_left"] == {"kv_cache_usage": 0.0, "kv_blocks_in_use": 0.0, "requests_running": 0.0, "requests_waiting": 0.0, "sessions_open": 0.0}
    assert rep["rss_start_bytes"] > 100 * 2**20 and rep["rss_end_bytes"] > 100 * 2**20
    assert rep["meta"]["warm_up_minutes"] == 0.02 and rep["rss_trace_mib"][0] == [0.0, round(rep["rss_start_bytes"] / 2**20)]
    assert len(rep["rss_trace_mib"]) >= 3 and rep["rss_trace_mib"][-1][1] == round(rep["rss_end_bytes"] / 2**20)
    assert rep["tracebacks"] == [] and rep["failures"] == [] and Path(rep["meta"]["server_log"]).exists()


def test_the_verdict_fails_on_each_kind_of_leak(tmp_path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO ok\nTraceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n")
    tally = Tally()
    tally.turn("completed")
    tally.turn("lost", "spoken question: no response.done in 300 s")
    tally.garbage_sent = 4
    tally.garbage_answered = 3
    tally.error("connection_closed", "the server closed the session", expected=False)
    measured = {"ran_minutes": 1.0, "rss_start_bytes": 1000, "rss_end_bytes": 1100,
                "after_clients_left": {"kv_cache_usage": 0.01, "kv_blocks_in_use": 3.0, "requests_running": 1.0, "requests_waiting": 0.0, "sessions_open": 2.0}}  # fmt: skip
    rep = report(SoakConfig(sessions=1, minutes=1.0), tally, measured, tracebacks(log), log)
    assert len(rep["failures"]) == 8, rep["failures"]
    assert rep["tracebacks"][0].endswith("ValueError: boom")
    assert text_report(rep).splitlines()[-1].startswith("FAIL: 1 lost turn(s); KV cache still 1.00% used (3 blocks)")

    clean = {**measured, "rss_end_bytes": 1099, "after_clients_left": dict.fromkeys(measured["after_clients_left"], 0.0)}
    tally.lost.clear()
    tally.outcomes["lost"] = 0
    tally.garbage_answered = 4
    tally.errors.clear()
    assert report(SoakConfig(), tally, clean, [], None)["failures"] == []
