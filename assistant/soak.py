"""Soak test: ``python -m assistant.soak [--sessions 16] [--minutes 30] [--url ws://HOST:PORT/v1/realtime]``.

N concurrent clients talk to one assistant server for M minutes, over the Realtime WebSocket API
(spoken questions streamed at real-time pace, typed questions, barge-ins) and the HTTP chat API,
with faults mixed in: disconnects mid-answer (a close frame or the TCP connection dropped), garbage
events while an answer streams (malformed JSON, unknown event types, invalid fields) and HTTP
streams left mid-answer (see :mod:`assistant.soak_callers`). Unless ``--url`` is given, the soak
starts its own server (``python -m assistant serve``, its output in a log file) on a free port of
127.0.0.1.

A warm-up comes first: one clean turn per client, then ``--warm-up-minutes`` (default 5) of the full
load, faults included, so that the allocators, the ONNX Runtime and CTranslate2 arenas and the
prefix cache reach the sizes the load needs; the server's RSS is noted after it. Every minute it
prints a progress line (and keeps the RSS for the report's trace); at the end, once every client has gone, it waits for the server to settle and
prints: turns attempted / completed / cancelled by the soak / lost, faults injected, errors seen,
KV cache usage and requests running or waiting (from ``/metrics``), Realtime sessions left open,
the server's RSS at start and end, and any traceback in the server's log. The exit code is 1 when
a turn was lost, KV blocks or sessions stay held, RSS grew by 10% or more, an invalid event got no
``error``, the server closed a session, a client hit an exception of its own, or the log holds a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from assistant.bench import DEFAULT_QUESTIONS, LocalServer, add_server_options, chosen_server_args, load_questions, machine
from assistant.bench_callers import speak_questions
from assistant.soak_callers import EPISODES, Caller, Plan, Tally

RSS_GROWTH_LIMIT = 0.10


@dataclass
class SoakConfig:
    """One soak run, from the command line."""

    url: str | None = None  # ws://HOST:PORT/v1/realtime of a running server; None: start one
    pid: int | None = None  # that server's process id, for its RSS
    server_log: Path | None = None  # that server's log, searched for tracebacks
    sessions: int = 16
    minutes: float = 30.0
    warm_up_minutes: float = 5.0  # full load before the RSS baseline
    questions: tuple[str, ...] = DEFAULT_QUESTIONS
    max_output_tokens: int = 32
    chunk_ms: int = 40
    turn_timeout_s: float = 300.0
    settle_s: float = 120.0
    progress_s: float = 60.0
    json_path: Path | None = None
    server_args: tuple[str, ...] = ()


# ---- the server, seen from outside ------------------------------------------------------------------
def scrape(http_url: str) -> dict[str, float]:
    """``/metrics``: each series summed over its labels."""
    text = httpx.get(http_url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def busy(m: dict[str, float]) -> dict[str, float]:
    """What must be back at 0 once every client has gone."""
    return {"kv_cache_usage": m.get("vllm:kv_cache_usage_perc", 0.0), "kv_blocks_in_use": m.get("vllm:kv_cache_blocks_in_use", 0.0),
            "requests_running": m.get("vllm:num_requests_running", 0.0),
            "requests_waiting": m.get("vllm:num_requests_waiting", 0.0), "sessions_open": m.get("assistant_realtime_sessions", 0.0)}  # fmt: skip


def rss_bytes(pid: int | None, m: dict[str, float]) -> int | None:
    """Resident memory of the server: /proc/PID/status (VmRSS), else ``process_resident_memory_bytes``."""
    if pid is not None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    value = m.get("process_resident_memory_bytes")
    return None if value is None else int(value)


def tracebacks(log: Path | None) -> list[str]:
    """Each traceback in the server's log (its first 40 lines)."""
    if log is None or not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return ["\n".join(lines[i : i + 40]) for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]


# ---- the run -------------------------------------------------------------------------------------------
def progress_line(start: float, tally: Tally, m: dict[str, float], rss: int | None) -> str:
    o = tally.outcomes
    return (f"[{(time.monotonic() - start) / 60:5.1f} min] turns {tally.attempted} attempted, {o['completed']} completed, "
            f"{o['cancelled']} cancelled by the soak, {o['lost']} lost | faults {sum(tally.faults.values())} | "
            f"errors {sum(tally.errors.values())} ({len(tally.unexpected)} unexpected) | sessions open "
            f"{m.get('assistant_realtime_sessions', 0):.0f} | KV {100 * m.get('vllm:kv_cache_usage_perc', 0):.1f}% | "
            f"RSS {_mib(rss)}")  # fmt: skip


async def report_progress(http_url: str, pid: int | None, tally: Tally, start: float, every_s: float,
                          trace: list[tuple[float, int | None]]) -> None:
    """A progress line every ``every_s``; each one's (minutes, RSS) is appended to ``trace``."""
    while True:
        await asyncio.sleep(every_s)
        try:
            m = await asyncio.to_thread(scrape, http_url)
        except httpx.HTTPError as exc:
            print(f"[progress] /metrics failed: {exc}", flush=True)
            continue
        rss = rss_bytes(pid, m)
        trace.append((round((time.monotonic() - start) / 60, 2), rss))
        print(progress_line(start, tally, m, rss), flush=True)


async def settle(http_url: str, timeout_s: float) -> dict[str, float]:
    """``/metrics`` once the server is idle again (or as it is after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await asyncio.to_thread(scrape, http_url)
        if not any(busy(m).values()) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(1.0)


async def soak(cfg: SoakConfig, ws_url: str, pid: int | None, tally: Tally) -> dict[str, Any]:
    """Warm-up, the timed run and the settling, against a server that answers at ``ws_url``."""
    http_url = ws_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).removesuffix("/v1/realtime")
    print(f"Speaking {len(cfg.questions)} questions with the bundled voice...", file=sys.stderr, flush=True)
    questions = await asyncio.to_thread(speak_questions, cfg.questions)
    async with httpx.AsyncClient() as http:
        model = (await http.get(http_url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        plan = Plan(ws_url, http_url, model, questions, cfg.questions, cfg.max_output_tokens, cfg.chunk_ms, cfg.turn_timeout_s)
        callers = [Caller(i, plan, tally, http) for i in range(cfg.sessions)]
        print(f"Warm-up: one clean turn for each of {cfg.sessions} clients...", file=sys.stderr, flush=True)
        await asyncio.gather(*(c.warm_up() for c in callers))
        if cfg.warm_up_minutes > 0:
            print(f"Warm-up: {cfg.warm_up_minutes:g} min of the full load...", file=sys.stderr, flush=True)
            until = time.monotonic() + cfg.warm_up_minutes * 60
            await asyncio.gather(*(c.run(until) for c in callers))
        warm = await settle(http_url, cfg.settle_s)
        rss_start = rss_bytes(pid, warm)
        start = time.monotonic()
        trace: list[tuple[float, int | None]] = [(0.0, rss_start)]
        print(progress_line(start, tally, warm, rss_start) + " (after warm-up)", flush=True)
        ticker = asyncio.create_task(report_progress(http_url, pid, tally, start, cfg.progress_s, trace))
        try:
            await asyncio.gather(*(c.run(start + cfg.minutes * 60) for c in callers))
        finally:
            ticker.cancel()
        ran_s = time.monotonic() - start
    end = await settle(http_url, cfg.settle_s)
    rss_end = rss_bytes(pid, end)
    trace.append((round((time.monotonic() - start) / 60, 2), rss_end))
    print(progress_line(start, tally, end, rss_end) + " (all clients gone)", flush=True)
    return {"ran_minutes": round(ran_s / 60, 2), "after_clients_left": busy(end), "rss_start_bytes": rss_start,
            "rss_end_bytes": rss_end, "rss_trace_mib": [(t, None if r is None else round(r / 2**20)) for t, r in trace]}  # fmt: skip


async def run(cfg: SoakConfig) -> dict[str, Any]:
    """The whole soak, against ``cfg.url`` or a server of its own; returns the report."""
    tally = Tally()
    server = None
    ws_url, pid, log = cfg.url, cfg.pid, cfg.server_log
    if ws_url is None:
        print("Starting the server (python -m assistant serve)...", file=sys.stderr, flush=True)
        server = LocalServer(cfg.server_args)
        ws_url, pid, log = server.url, server.proc.pid, Path(server.log.name)
    try:
        if server is not None:
            await asyncio.to_thread(server.wait_ready)
        measured = await soak(cfg, ws_url, pid, tally)
    finally:
        if server is not None:
            server.stop(keep_log=True)
    return report(cfg, tally, measured, tracebacks(log), log)


def report(cfg: SoakConfig, tally: Tally, measured: dict[str, Any], found: list[str], log: Path | None) -> dict[str, Any]:
    """The run's numbers, and the list of what failed (empty: the soak passed)."""
    left = measured["after_clients_left"]
    start, end = measured["rss_start_bytes"], measured["rss_end_bytes"]
    growth = None if not start or end is None else (end - start) / start
    garbage_unanswered = tally.garbage_sent - tally.garbage_answered
    broken = tally.errors["connection_closed"] + tally.errors["client_exception"]
    failures = [msg for bad, msg in (
        (tally.outcomes["lost"] > 0, f"{tally.outcomes['lost']} lost turn(s)"),
        (left["kv_cache_usage"] > 0 or left["kv_blocks_in_use"] > 0,
         f"KV cache still {100 * left['kv_cache_usage']:.2f}% used ({left['kv_blocks_in_use']:.0f} blocks) after the clients left"),
        (left["requests_running"] + left["requests_waiting"] > 0, "engine requests still running or waiting"),
        (left["sessions_open"] > 0, f"{left['sessions_open']:.0f} Realtime session(s) left open"),
        (growth is not None and growth >= RSS_GROWTH_LIMIT, f"RSS grew {100 * (growth or 0):.1f}% (limit {100 * RSS_GROWTH_LIMIT:.0f}%)"),
        (garbage_unanswered > 0, f"{garbage_unanswered} invalid event(s) got no error event"),
        (bool(found), f"{len(found)} traceback(s) in the server's log"),
        (broken > 0, f"{broken} session(s) closed by the server or client exception(s)"),
    ) if bad]  # fmt: skip
    return {
        "meta": {**machine(), "command": " ".join(["python -m assistant.soak", *sys.argv[1:]]), "url": cfg.url or "own server",
                 "server_args": list(cfg.server_args), "server_log": str(log) if log else None, "sessions": cfg.sessions,
                 "minutes": cfg.minutes, "warm_up_minutes": cfg.warm_up_minutes, "max_output_tokens": cfg.max_output_tokens, "episodes": [list(e) for e in EPISODES]},
        "turns": {"attempted": tally.attempted, **{k: tally.outcomes[k] for k in ("completed", "cancelled", "unheard", "lost")}},
        "lost": tally.lost, "faults": dict(tally.faults), "faults_injected": sum(tally.faults.values()),
        "garbage": {"sent": tally.garbage_sent, "answered_with_error": tally.garbage_answered},
        "errors": dict(tally.errors), "unexpected_errors": tally.unexpected[:50], "sessions_opened": tally.sessions,
        "refused_at_session_limit": tally.refused, **measured, "rss_growth": None if growth is None else round(growth, 4),
        "tracebacks": found[:5], "failures": failures,
    }  # fmt: skip


def text_report(r: dict[str, Any]) -> str:
    t, left = r["turns"], r["after_clients_left"]
    growth = "n/a (no server process to read)" if r["rss_growth"] is None else f"{100 * r['rss_growth']:+.1f}%"
    lines = [
        f"soak: {r['meta']['sessions']} sessions for {r['ran_minutes']} min on {r['meta']['cores']} cores "
        f"(load average at the end {', '.join(f'{x:.1f}' for x in r['meta']['load_average'])})",
        f"turns attempted {t['attempted']}: completed {t['completed']}, cancelled by the soak {t['cancelled']}, "
        f"unheard {t['unheard']}, lost {t['lost']}",
        f"faults injected {r['faults_injected']}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items())),
        f"garbage events answered with an error: {r['garbage']['answered_with_error']} of {r['garbage']['sent']}",
        f"Realtime sessions opened {r['sessions_opened']} (refused at the session limit and retried: {r['refused_at_session_limit']})",
        "errors seen: " + (", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"),
        f"unexpected errors: {len(r['unexpected_errors'])}" + "".join(f"\n  {e}" for e in r["unexpected_errors"][:10]),
        f"after the clients left: KV cache usage {100 * left['kv_cache_usage']:.2f}% "
        f"(leaked KV blocks: {left['kv_blocks_in_use']:.0f}), requests running "
        f"{left['requests_running']:.0f}, waiting {left['requests_waiting']:.0f}, Realtime sessions left open {left['sessions_open']:.0f}",
        f"server RSS after warm-up {_mib(r['rss_start_bytes'])}, at the end {_mib(r['rss_end_bytes'])} ({growth})",
        f"tracebacks in the server's log: {len(r['tracebacks'])}" + (f" ({r['meta']['server_log']})" if r["meta"]["server_log"] else ""),
    ]  # fmt: skip
    lines += [f"lost: {why}" for why in r["lost"][:20]]
    lines += [f"traceback:\n{tb}" for tb in r["tracebacks"][:2]]
    lines.append("PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"]))
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def parse_args(argv: list[str] | None = None) -> SoakConfig:
    p = argparse.ArgumentParser(prog="python -m assistant.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="ws://HOST:PORT/v1/realtime of a running server (default: start one)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS (default: process_resident_memory_bytes)")
    p.add_argument("--server-log", type=Path, help="with --url: the server's log, searched for tracebacks")
    p.add_argument("--sessions", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the clients keep starting turns (default 30)")
    p.add_argument("--warm-up-minutes", type=float, default=5.0,
                   help="minutes of the full load before the RSS baseline is taken (default 5; 0: one clean turn per client only)")
    p.add_argument("--questions", type=Path, help="JSON list of questions (strings or {question_en: ...}) or a text file, one per line")
    p.add_argument("--max-output-tokens", type=int, default=32, help="each answer's limit (default 32)")
    p.add_argument("--chunk-ms", type=int, default=40, help="audio packet length, sent at real-time pace (default 40)")
    p.add_argument("--turn-timeout", type=float, default=300.0, help="seconds a turn may take before it counts as lost (default 300)")
    p.add_argument("--settle", type=float, default=120.0, help="seconds the server may take to go idle once the clients left (default 120)")
    p.add_argument("--progress", type=float, default=60.0, help="seconds between progress lines (default 60)")
    p.add_argument("--json", type=Path, help="write the whole report here")
    add_server_options(p, "the soak")
    a = p.parse_args(argv)
    if a.warm_up_minutes < 0:
        p.error("--warm-up-minutes must be >= 0")
    if a.sessions < 1 or a.minutes <= 0 or a.chunk_ms < 10 or a.max_output_tokens < 1 or a.progress <= 0:
        p.error("--sessions and --max-output-tokens must be >= 1, --minutes and --progress > 0, --chunk-ms >= 10")
    server_args = chosen_server_args(a)
    if a.url and server_args:
        p.error("server options only apply when the soak starts its own server (no --url)")
    if not a.url and (a.pid or a.server_log):
        p.error("--pid and --server-log go with --url (the soak knows its own server)")
    return SoakConfig(
        url=a.url, pid=a.pid, server_log=a.server_log, sessions=a.sessions, minutes=a.minutes, warm_up_minutes=a.warm_up_minutes,
        questions=load_questions(a.questions) if a.questions else DEFAULT_QUESTIONS, max_output_tokens=a.max_output_tokens,
        chunk_ms=a.chunk_ms, turn_timeout_s=a.turn_timeout, settle_s=a.settle, progress_s=a.progress, json_path=a.json,
        server_args=server_args,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        report_ = asyncio.run(run(cfg))
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text_report(report_), flush=True)
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(report_, indent=1, ensure_ascii=False))
    return 1 if report_["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
