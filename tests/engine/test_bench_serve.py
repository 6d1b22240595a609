"""The load generator: a short real run against ``python -m engine.serving``, and its arithmetic."""

from __future__ import annotations

import json
import math
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from engine.bench.cli import main as bench_main
from engine.bench.serve import BenchConfig, RequestResult, arrival_gaps, make_prompts, parse_slo, summarize


@pytest.fixture(scope="module")
def served_url(llm_gguf_path, tmp_path_factory):
    """``python -m engine.serving`` with the embedded model, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.serving", "--model", str(llm_gguf_path), "--port", str(port), "--log-level", "warning",
             "--max-num-seqs", "8", "--num-kv-blocks", "256"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up:\n" + log.read_text()
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_short_run_writes_json_and_a_png(served_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["serve", "--base-url", served_url, "--num-prompts", "6", "--request-rate", "8", "--max-concurrency", "3",
            "--input-len", "8:24", "--output-len", "6", "--ignore-eos", "--baseline-requests", "2",
            "--slo", "ttft=5s,tpot=1s", "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    assert bench_main(argv) == 0
    table = capsys.readouterr().out
    for row in ("| TTFT |", "| TPOT |", "| ITL |", "| E2E |", "goodput", "concurrency 1"):
        assert row in table

    record = json.loads(out_json.read_text())
    assert [step["request_rate"] for step in record["sweep"]] == [8]
    load, base = record["sweep"][0]["load"], record["baseline_concurrency_1"]
    assert record["command"].startswith("python -m engine.bench serve --base-url")
    assert record["model"] == "SmolLM2-135M-Instruct.Q4_1"  # from GET /v1/models
    assert (load["completed"], load["failed"], base["completed"]) == (6, 0, 2)
    assert load["output_tokens"] == 6 * 6 and len(record["sweep"][0]["requests"]) == 6
    assert all(r["output_tokens"] == 6 and len(r["itl"]) == 5 and r["prompt_tokens"] >= 8 for r in record["sweep"][0]["requests"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = load[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert load["goodput"] <= load["request_throughput"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The server saw exactly the warm-up, the baseline and the load.
    metrics = httpx.get(served_url + "/metrics").text
    finished = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total"))
    assert finished == 1 + 2 + 6


def test_a_rate_sweep_runs_each_rate_and_plots_against_the_offered_rate(served_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["serve", "--base-url", served_url, "--num-prompts", "3", "--request-rate", "4,inf", "--input-len", "8",
            "--output-len", "4", "--ignore-eos", "--baseline-requests", "0", "--slo", "ttft=5s",
            "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    before = _finished(served_url)
    assert bench_main(argv) == 0
    table = capsys.readouterr().out
    assert "| offered rate |" in table and "| 4 req/s | 3 |" in table and "| inf | 3 |" in table
    sweep = json.loads(out_json.read_text())["sweep"]
    assert [s["request_rate"] for s in sweep] == [4, "inf"]
    assert all(s["load"]["completed"] == 3 and s["load"]["good_requests"] <= 3 for s in sweep)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _finished(served_url) - before == 1 + 3 + 3  # warm-up, then 3 requests at each rate


def _finished(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total"))


def test_an_unreachable_server_is_an_error_not_a_crash(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    assert bench_main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--no-progress"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_slo_parsing():
    assert parse_slo("ttft=200ms,tpot=30ms,e2e=2s") == {"ttft": 0.2, "tpot": 0.03, "e2e": 2.0}
    assert parse_slo("ttft:150, e2el=1.5s") == {"ttft": 0.15, "e2e": 1.5}  # vLLM's spelling, bare ms
    for bad in ("ttft=fast", "itl=3ms", "ttft"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_arrivals_are_poisson_with_gamma_burstiness():
    rng = random.Random(0)
    poisson = arrival_gaps(20000, 4.0, 1.0, rng)
    bursty = arrival_gaps(20000, 4.0, 0.25, rng)
    assert statistics.mean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.05)  # same rate ...
    assert statistics.stdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert statistics.stdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.1)  # ... CV 1/sqrt(shape)
    assert arrival_gaps(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        RequestResult(True, ttft=0.1, e2e=1.0, output_tokens=11),  # tpot 90 ms
        RequestResult(True, ttft=0.3, e2e=1.2, output_tokens=11),  # ttft over
        RequestResult(True, ttft=0.1, e2e=3.1, output_tokens=11),  # tpot 300 ms
        RequestResult(False, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0, slo={"ttft": 0.2, "tpot": 0.1})
    assert (s["completed"], s["failed"], s["good_requests"]) == (3, 1, 1)
    assert s["goodput"] == 0.5 and s["request_throughput"] == 1.5 and s["output_throughput"] == 33 / 2
    assert s["ttft_ms"]["mean"] == pytest.approx(500 / 3)
    assert summarize(results, 2.0, {})["goodput"] is None


def test_prompts_from_a_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b", "max_tokens": 3}\n{"prompt": "c"}\n')
    cfg = BenchConfig(base_url="http://x", dataset=path, output_len=(5, 5))
    prompts = make_prompts(cfg, 3, random.Random(0))
    assert [(p.text, p.max_tokens) for p in prompts] == [("a b", 3), ("c", 5), ("a b", 3)]
    words = make_prompts(BenchConfig(base_url="http://x", input_len=(4, 6)), 20, random.Random(0))
    assert all(4 <= len(p.text.split()) <= 6 for p in words)
