"""Voice load generator: ``python -m assistant.bench [--callers 1,8,32] [--turns 2] [--config 8b|real] [--json F]``.

N simulated callers talk to the assistant at once over the Realtime WebSocket API, as
conversations (:mod:`assistant.bench_callers`): each streams a real spoken handbook question
(synthesized once by the bundled hibari voice) at real-time pace in ``--chunk-ms`` packets, keeps
streaming silence like an open microphone, waits for the spoken answer to finish, pauses 1-3 s
(``--pause-s``, seeded by ``--seed``) and asks its next question; callers start at random offsets
too, so their questions spread over time. A phase ends after ``--turns`` questions per caller or
``--duration-s``. ``--burst`` adds, per caller count, a phase where every caller asks one
question at the same instant (reported apart). Unless ``--url`` is given, the bench starts its
own server (``python -m assistant serve``) on a free port of 127.0.0.1 and stops it at the end;
``--ab 32,64`` then runs those caller counts again against a second server started with
``--coscheduler off``. ``--client-processes N`` spreads the callers over N client processes, so
that at 64-128 callers the client's own event loop (every caller's audio sent in real time) is not
mistaken for the server's limit.

Measured per turn:
- the server's timeline (``response.timeline``): each stage's share, speech_end -> first audio
  sent with and without the VAD hangover, prompt and cached tokens;
- at the client: from the instant the question's last voiced sample was sent (its true end of
  speech, -40 dB envelope) to the first answer audio received, and the same minus the configured
  hangover (the anchors' "voice-to-voice minus VAD stop");
- the transcript against the question (word error rate);
- false endpoints: the server endpointed (``input_audio_buffer.committed``) or answered
  (``response.created``) before the question's last voiced sample was sent (every second
  question of a caller is asked with a mid-sentence pause: see :mod:`assistant.bench_callers`).
After each phase, the server's memory by owner (``assistant_memory_bytes`` on ``/metrics``).

Reported per phase: p50/p95/p99 of each, a table on stdout, and with ``--json`` a file with
``gpu``, ``date``, ``command``, ``results`` (:func:`assistant.bench_report.results`: per caller
count the p50/p95/p99 of endpoint and speech_end to first audio, every stage, lost turns, memory)
and every turn; ``--plot`` draws a waterfall PNG (one row per turn, the stages stacked from speech_end).

Configurations (``--config``; server options given as well are passed after them, so they win):
- ``8b``: the Llama-3.1-8B shape with random weights (engine/configs/llama-3.1-8b.json) and the
  bundled handbook as its cached prefix, answers capped at 24 tokens, a Whisper large-v3-turbo
  shape with random weights, the hibari voice (ONNX, on the CPU); the LLM and Whisper on CUDA;
- ``real``: the embedded models (Whisper base, the default LLM, hibari) with the engine on CUDA.
Any other ``python -m assistant serve`` option reaches the server with ``--server-arg=--flag=value``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from assistant.bench_callers import Pattern, Question, run_phase, speak_paused, speak_questions
from assistant.bench_report import caller_count_results, false_endpoints, plot, results, summarize, table
from assistant.config import ServerConfig

DEFAULT_QUESTIONS = (
    "How do I apply for annual leave?",
    "How many days of annual leave do I get per year?",
    "What is the minimum length of a password?",
    "From which day of sick leave do I need a doctor's note?",
    "How many days a week can I work remotely?",
    "What is the deadline for submitting an expense claim?",
    "How long is the probation period?",
    "How much is the home office allowance?",
)
VERSIONED = ("torch", "faster-whisper", "ctranslate2", "onnxruntime", "webrtcvad-wheels", "hibari-tts", "websockets",
             "fastapi", "uvicorn", "numpy")  # fmt: skip
LLAMA_8B = Path(__file__).resolve().parent.parent / "engine" / "configs" / "llama-3.1-8b.json"
# --config NAME: the server options it stands for. The engine plans in 80% of the GPU, leaving the rest
# to Whisper (weights, KV cache, graphs), and decodes up to 128 answers at once (one per caller at the
# most); random 8B answers are capped at 24 tokens, about a real answer's first sentence: the voice reads every
# token of a random answer, and the callers wait for the answer's audio to end before their next question (a
# random model never stops by itself).
CONFIGS: dict[str, tuple[str, ...]] = {
    "8b": ("--model", str(LLAMA_8B), "--load-format", "dummy", "--device", "cuda", "--gpu-memory-utilization", "0.8",
           "--max-num-seqs", "128", "--max-tokens", "24", "--asr-load-format", "dummy", "--asr-device", "cuda", "--tts-backend", "hibari",
           "--no-refusal-gate"),  # the random Whisper's transcripts are noise: the gate would refuse them all
    "real": ("--device", "cuda", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "128"),
}  # fmt: skip
COSCHEDULER_OFF = ("--coscheduler", "off")  # the A/B's second server


@dataclass
class BenchConfig:
    """One run, from the command line."""

    url: str | None = None
    callers: tuple[int, ...] = (1, 4)
    pattern: Pattern = Pattern()
    burst: bool = False
    ab: tuple[int, ...] = ()  # caller counts run again against a server with the co-scheduler off
    config_name: str = "custom"
    questions: tuple[str, ...] = DEFAULT_QUESTIONS
    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    server_args: tuple[str, ...] = ()
    server_log_dir: Path | None = None  # keep every started server's log here (else only a failed run's)
    client_processes: int = 1  # the callers' client processes (one event loop each)


def machine() -> dict[str, Any]:
    """Date, CPU, GPU (nvidia-smi) and package versions, for the results file."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu": cpu, "gpu": gpu_name(), "cores": os.cpu_count(),
            "load_average": os.getloadavg(), "platform": platform.platform(), "versions": versions}  # fmt: skip


# ---- the servers --------------------------------------------------------------------------------------
class LocalServer:
    """``python -m assistant serve`` on a free port of 127.0.0.1, its output in a log file."""

    def __init__(self, args: tuple[str, ...], log_dir: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.keep_log = log_dir is not None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="assistant-serve-", suffix=".log", delete=False,
                                               dir=log_dir)  # fmt: skip
        if "--max-sessions-per-client" not in args:  # every caller of this server comes from 127.0.0.1
            sessions = args[args.index("--max-sessions") + 1] if "--max-sessions" in args else str(ServerConfig.max_sessions)
            args = (*args, "--max-sessions-per-client", sessions)
        cmd = [sys.executable, "-m", "assistant", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log.name}:\n{self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start in {timeout_s:.0f} s; see {self.log.name}")

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def stop(self, keep_log: bool) -> None:
        """Stop the server; its log is deleted unless ``keep_log`` (a failed run) or a log directory was given."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if keep_log or self.keep_log:
            print(f"the server's log: {self.log.name}", file=sys.stderr)
        else:
            os.unlink(self.log.name)


async def run(cfg: BenchConfig) -> dict[str, Any]:
    """Every phase against ``cfg.url`` (or servers of our own); returns the report."""
    print(f"Speaking {len(cfg.questions)} questions with the bundled voice...", file=sys.stderr, flush=True)
    questions = speak_questions(cfg.questions)
    paused = speak_paused(cfg.questions, cfg.pattern.pauses_ms) if cfg.pattern.pauses_ms and cfg.pattern.turns > 1 else []
    for q in paused:
        print(f"  with a {q.pause_ms} ms pause: {q.text}", file=sys.stderr)
    phases: list[dict[str, Any]] = []
    plan = [("", cfg.server_args, cfg.callers)]
    if cfg.ab:
        plan.append(("coscheduler off", (*cfg.server_args, *COSCHEDULER_OFF), cfg.ab))
    for server_name, args, caller_counts in plan:
        await run_server(cfg, server_name, args, caller_counts, questions, paused, phases)
    pattern = {"name": "conversation", **{k: v for k, v in asdict(cfg.pattern).items() if k != "burst"}}
    return {"gpu": gpu_name(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python -m assistant.bench", *sys.argv[1:]]),
            "results": results(cfg.config_name, pattern, phases),
            "meta": {**machine(), "url": cfg.url or "own server", "server_args": list(cfg.server_args)}, "phases": phases}  # fmt: skip


async def run_server(cfg: BenchConfig, name: str, args: tuple[str, ...], caller_counts: tuple[int, ...], questions: list[Question],
                     paused: list[Question], phases: list[dict[str, Any]]) -> None:  # fmt: skip
    """Every phase of ``caller_counts`` against one server (ours, started with ``args``, unless
    ``cfg.url``), appended to ``phases``; ``name`` is "" or what sets the server apart ("coscheduler off")."""
    server = None
    url = cfg.url
    if url is None:
        print(f"Starting the server (python -m assistant serve {' '.join(args)})...", file=sys.stderr, flush=True)
        server = LocalServer(args, cfg.server_log_dir)
        url = server.url
    ok = False
    try:
        if server is not None:
            await asyncio.to_thread(server.wait_ready)
        patterns = [cfg.pattern] + ([Pattern(**{**asdict(cfg.pattern), "burst": True})] if cfg.burst and not name else [])
        for pattern in patterns:
            for n in caller_counts:
                await asyncio.to_thread(wait_sessions_closed, http_base(url))
                before = await asyncio.to_thread(scrape_metrics, http_base(url))
                started = time.monotonic()
                turns = await run_phase(url, n, questions, paused, pattern, cfg.progress, cfg.client_processes)
                wall_s = time.monotonic() - started
                after = await asyncio.to_thread(scrape_metrics, http_base(url))
                lag, gil = (lag_quantiles(histogram_of(before, name_), histogram_of(after, name_)) for name_ in (LOOP_LAG, GIL_WAIT))
                phases.append({"callers": n, "pattern": pattern.name, "server": name, "summary": summarize(turns),
                               "false_endpoints": false_endpoints(turns),
                               "results": caller_count_results(turns, memory_of(after), lag, gil, engine_steps(before, after, wall_s)),
                               "turns": [asdict(r) for r in turns]})  # fmt: skip
        ok = all(not p["results"]["lost_turns"] for p in phases)
    finally:
        if server is not None:
            server.stop(keep_log=not ok)


def http_base(ws_url: str) -> str:
    """http://HOST:PORT of a ws://HOST:PORT/v1/realtime address."""
    return ws_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).split("/v1/", 1)[0]


def wait_sessions_closed(http_url: str, timeout_s: float = 60.0) -> None:
    """Until the server holds no Realtime session (the last phase's callers have all been let go), so
    that a phase never meets the session limit because of the one before it; at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(http_url + "/metrics", timeout=30).text
        except httpx.HTTPError:  # no server there, or not ours: the phase's callers say so
            return
        if not any(s.name == "assistant_realtime_sessions" and s.value > 0
                   for family in text_string_to_metric_families(text) for s in family.samples):  # fmt: skip
            return
        time.sleep(0.5)


def scrape_metrics(http_url: str) -> str:
    """The server's ``/metrics`` text ("" if no server answers: the phase's callers then say what is wrong)."""
    try:
        return httpx.get(http_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return ""


LOOP_LAG = "assistant_event_loop_lag_seconds"
GIL_WAIT = "assistant_gil_wait_seconds"


def histogram_of(metrics: str, name: str) -> dict[float, float]:
    """Histogram ``name`` in a ``/metrics`` text: bucket bound (s) -> cumulative count ({} if none)."""
    return {float(sample.labels["le"]): sample.value for family in text_string_to_metric_families(metrics)
            for sample in family.samples if sample.name == name + "_bucket"}  # fmt: skip


def lag_quantiles(before: dict[float, float], after: dict[float, float]) -> dict[str, float | None] | None:
    """p50/p95/p99 (ms, as the upper bound of the bucket holding each; None above the largest
    bound) of the lag observed between two scrapes, and their count; None if the server measured none."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    out: dict[str, float | None] = {}
    for q in (0.5, 0.95, 0.99):
        bound = next(b for b, c in zip(bounds, counts) if c >= q * counts[-1])
        out[f"p{round(q * 100)}"] = round(bound * 1000, 3) if bound != float("inf") else None
    return out | {"n": counts[-1]}


def memory_of(metrics: str) -> dict[str, dict[str, float]]:
    """device -> owner -> bytes, from ``assistant_memory_bytes`` in a ``/metrics`` text ({} if it has none)."""
    memory: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "assistant_memory_bytes":
                memory.setdefault(sample.labels["device"], {})[sample.labels["owner"]] = sample.value
    return memory


def engine_counters(metrics: str) -> dict[str, dict[str, float]]:
    """The engine's own counters (``engine_*_total``) in a ``/metrics`` text: name -> its ``mode``
    label ("" if none) -> value, summed over the other labels."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name.startswith("engine_") and sample.name.endswith("_total"):
                by_mode = out.setdefault(sample.name.removesuffix("_total"), {})
                mode = sample.labels.get("mode", "")
                by_mode[mode] = by_mode.get(mode, 0.0) + sample.value
    return out


def engine_steps(before: str, after: str, wall_s: float) -> dict[str, Any] | None:
    """Where the engine's time went in a phase, from two ``/metrics`` texts ``wall_s`` apart: by
    execution path its steps, mean host and device ms a step and tokens a step, and the shares of
    the phase the engine thread spent in steps (``host_busy``) and the GPU in them (``device_busy``;
    None without CUDA). None if the server exports no engine step counters."""
    old, new = engine_counters(before), engine_counters(after)

    def delta(name: str) -> dict[str, float]:
        return {k: v - old.get(name, {}).get(k, 0.0) for k, v in new.get(name, {}).items()}

    steps, host, tokens, device = (delta("engine_" + n) for n in ("steps", "step_seconds", "step_tokens", "step_device_seconds"))
    if not steps or wall_s <= 0:
        return None
    by_mode = {mode: {"steps": int(n), "host_ms": round(1e3 * host.get(mode, 0.0) / n, 2),
                      "device_ms": round(1e3 * device[mode] / n, 2) if mode in device else None,
                      "tokens": round(tokens.get(mode, 0.0) / n, 1)}
               for mode, n in sorted(steps.items()) if n > 0}  # fmt: skip
    return {"by_mode": by_mode, "host_busy": round(sum(host.values()) / wall_s, 3),
            "device_busy": round(sum(device.values()) / wall_s, 3) if device else None,
            "device_idle_between_steps_s": round(delta("engine_device_idle_seconds").get("", 0.0), 3) if device else None}


def gpu_name() -> str | None:
    """The first GPU's name (nvidia-smi), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def counts(value: str) -> list[int]:
    """"1,8,32" (or one number) -> [1, 8, 32]."""
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected caller counts like 1,8,32, got {value!r}") from None


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python -m assistant.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", help="ws://HOST:PORT/v1/realtime of a running server (default: start one)")
    p.add_argument("--callers", type=counts, nargs="+", default=[[1, 4]], help="concurrent callers per phase: 1,8,32 or 1 8 32 (default 1,4)")
    p.add_argument("--turns", "--turns-per-caller", dest="turns", type=int, default=2, help="questions per caller (default 2)")
    p.add_argument("--duration-s", type=float, help="no caller starts a question after this long into its phase")
    p.add_argument("--pause-s", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"),
                   help="a caller's pause between an answer and its next question, uniform (default 1 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds the callers' pauses and start offsets (default 0)")
    p.add_argument("--burst", action="store_true", help="also, per caller count, every caller asks one question at the same instant")
    p.add_argument("--ab", type=counts, default=[], help="caller counts run again against a second server with --coscheduler off (e.g. 32,64)")
    p.add_argument("--config", choices=sorted(CONFIGS), help="server preset: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in CONFIGS.items()))
    p.add_argument("--questions", type=Path, help="JSON list of questions (strings or {question_en: ...}) or a text file, one per line")
    p.add_argument("--max-output-tokens", type=int, help="cap each answer (session.update)")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="spread the callers over N client processes (default 1), so that the client's own event loop is not the limit")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio packet length, sent at real-time pace (default 20)")
    p.add_argument("--pause-ms", type=int, nargs="*", default=[300, 400, 500, 600, 700],
                   help="mid-sentence pauses of the questions asked every second turn, in turn (default 300 400 500 600 700; "
                        "none given: no pauses)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a turn may take (default 180)")
    p.add_argument("--json", type=Path, help="write the whole report here")
    p.add_argument("--plot", type=Path, help="write the waterfall PNG here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--server-log", type=Path, metavar="DIR", help="keep the log of every server the bench starts in DIR (default: only a failed run's)")
    add_server_options(p, "the bench")
    p.add_argument("--server-arg", action="append", default=[], metavar="=--FLAG[=VALUE]",
                   help="any other python -m assistant serve argument, passed on as given (repeatable; write --server-arg=--flag=value)")
    a = p.parse_args(argv)
    callers = tuple(n for group in a.callers for n in group)
    pause = tuple(a.pause_s)
    if a.turns < 1 or not callers or min(callers) < 1 or min(a.ab, default=1) < 1 or a.chunk_ms < 10 or a.client_processes < 1:
        p.error("--turns, --callers and --client-processes must be >= 1, --chunk-ms >= 10")
    if not 0 <= pause[0] <= pause[1] or (a.duration_s is not None and a.duration_s <= 0):
        p.error("--pause-s needs 0 <= MIN <= MAX, --duration-s > 0")
    server_args = (*CONFIGS.get(a.config, ()), *chosen_server_args(a), *a.server_arg)
    if a.url and server_args:
        p.error("server options only apply when the bench starts its own server (no --url)")
    if a.url and a.ab:
        p.error("--ab starts a second server of its own: it needs the bench to start its servers (no --url)")
    if not a.url and "--max-sessions" not in server_args:  # the default limit (16) would turn callers away
        server_args = (*server_args, "--max-sessions", str(max(ServerConfig.max_sessions, *callers, *a.ab)))
    pattern = Pattern(turns=a.turns, duration_s=a.duration_s, pause_s=pause, seed=a.seed, chunk_ms=a.chunk_ms,  # type: ignore[arg-type]
                      timeout_s=a.timeout, max_output_tokens=a.max_output_tokens, pauses_ms=tuple(a.pause_ms))  # fmt: skip
    return BenchConfig(
        url=a.url, callers=callers, pattern=pattern, burst=a.burst, ab=tuple(a.ab), config_name=a.config or "custom",
        questions=load_questions(a.questions) if a.questions else DEFAULT_QUESTIONS, json_path=a.json, plot_path=a.plot,
        progress=a.progress, server_args=server_args, server_log_dir=a.server_log, client_processes=a.client_processes,
    )  # fmt: skip


SERVER_OPTIONS = ("docs", "model", "asr", "lang", "max_tokens", "max_sessions", "max_sessions_per_client", "hangover_ms",
                  "output_lead_ms", "device", "quantization", "load_format", "tokenizer", "gpu_memory_utilization", "max_num_seqs", "tts_workers",
                  "asr_device", "asr_backend", "asr_load_format", "coscheduler", "endpointing", "speculative_pause_ms")  # fmt: skip


def add_server_options(p: argparse.ArgumentParser, who: str) -> None:
    """The ``python -m assistant serve`` options passed on when ``who`` starts its own server."""
    server = p.add_argument_group(f"server options (when {who} starts its own; see python -m assistant serve --help)")
    for name in SERVER_OPTIONS:
        server.add_argument("--" + name.replace("_", "-"))
    server.add_argument("--early-prefill", action="store_true")


def chosen_server_args(a: argparse.Namespace) -> tuple[str, ...]:
    """The server options given on the command line (see :func:`add_server_options`), as arguments."""
    args: list[str] = []
    for name in SERVER_OPTIONS:
        if getattr(a, name) is not None:
            args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
    if a.early_prefill:
        args.append("--early-prefill")
    return tuple(args)


def load_questions(path: Path) -> tuple[str, ...]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        items = json.loads(text)
        return tuple(item["question_en"] if isinstance(item, dict) else str(item) for item in items)
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        report = asyncio.run(run(cfg))
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(table(report["phases"]))
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    if cfg.plot_path:
        plot(report["phases"], cfg.plot_path)
    failed = [t for p in report["phases"] for t in p["turns"] if t["error"] or not t["timeline"] or t["client_s2a_ms"] is None]
    if failed:
        print(f"{len(failed)} turn(s) lost, e.g.: {failed[0]['error'] or 'no answer audio or no timeline'}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
