"""The text-mode CLI, run as a real subprocess on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "assistant.cli", *args], cwd=REPO, input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )


def small_docs(tmp_path):
    (tmp_path / "leave.md").write_text(
        "# Annual leave\nEmployees get 20 days of annual leave. Apply with form HR-01 in PeopleHub.\n", encoding="utf-8"
    )
    return tmp_path


def test_one_shot_question_streams_an_answer_with_timings(tmp_path):
    r = cli("-q", "How many days of annual leave do I get?", "--docs", str(small_docs(tmp_path)), "--timings", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 5
    assert "ttft" in r.stderr and "tok/s" in r.stderr and "cached" in r.stderr


def test_interactive_mode_caches_the_documents_prefix_across_turns(tmp_path):
    r = cli("--docs", str(small_docs(tmp_path)), "--timings", "--max-tokens", "12", stdin="How many days?\nWhich form?\n")
    assert r.returncode == 0, r.stderr
    timings = [line for line in r.stderr.splitlines() if line.startswith("[ttft")]
    assert len(timings) == 2
    cached_second = int(timings[1].split("tokens, ")[1].split(" cached")[0])
    assert cached_second > 0  # the second turn reused the documents (and first turn) KV


def test_missing_docs_folder_is_a_one_line_error_with_exit_code_2(tmp_path):
    r = cli("-q", "hi", "--docs", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model_is_a_one_line_error_with_exit_code_2(tmp_path):
    r = cli("-q", "hi", "--model", str(tmp_path / "model.gguf"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_folder_that_is_not_a_model_is_a_clear_error(tmp_path):
    r = cli("-q", "hi", "--model", str(tmp_path), "--docs", str(small_docs(tmp_path)))
    assert r.returncode == 2 and "is not a model" in r.stderr and "Traceback" not in r.stderr
