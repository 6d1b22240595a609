"""Voice load generator: ``python -m assistant.bench [--callers 1 4] [--turns 2] [--json F] [--plot F.png]``.

N simulated callers talk to the assistant at once over the Realtime WebSocket API. Each streams a
real spoken handbook question (synthesized once by the bundled hibari voice) at real-time pace in
``--chunk-ms`` packets, keeps streaming silence like an open microphone, and waits for the spoken
answer to finish before asking its next question. Unless ``--url`` is given, the bench starts its
own server (``python -m assistant serve``) on a free port of 127.0.0.1 and stops it at the end.

Measured per turn:
- the server's timeline (``response.timeline``): each stage's share, speech_end -> first audio
  sent with and without the VAD hangover, prompt and cached tokens;
- at the client: from the instant the question's last voiced sample was sent (its true end of
  speech, -40 dB envelope) to the first answer audio received, and the same minus the configured
  hangover (the anchors' "voice-to-voice minus VAD stop");
- the transcript against the question (word error rate);
- false endpoints: the server endpointed (``input_audio_buffer.committed``) or answered
  (``response.created``) before the question's last voiced sample was sent.

Every second turn of a caller (turns 1, 3, ...) asks its question with a mid-sentence pause
(``--pause-ms``, default 300-700 ms in turn): its two halves are synthesized apart, trimmed to
their speech and joined with that much silence; the pauses are printed. A turn whose question was
cut by a false endpoint ends with the answer to its last part; its transcript is every part heard.

Reported per caller count: p50/p90/p99 of each, a table on stdout, everything in ``--json``, and
a waterfall PNG (``--plot``: one row per turn, the stages stacked from speech_end).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from assistant.bench_report import plot, table
from assistant.config import ServerConfig
from assistant.timeline import quantile
from speech.word_errors import word_error_rate

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
RATE = 24000
LEAD_SILENCE_S = 0.3
VERSIONED = ("torch", "faster-whisper", "ctranslate2", "onnxruntime", "webrtcvad-wheels", "hibari-tts", "websockets",
             "fastapi", "uvicorn", "numpy")  # fmt: skip


@dataclass(frozen=True)
class Question:
    """A spoken question: PCM16 at 24 kHz with lead silence, and where its speech ends."""

    text: str
    pcm: bytes
    speech_end_s: float
    pause_ms: int | None = None  # silence in the middle (None: spoken whole)


@dataclass
class TurnResult:
    """One caller's turn, as the client saw it and as the server reported it."""

    caller: int
    turn: int
    question: str
    transcript: str = ""
    answer: str = ""
    status: str = ""
    wer: float | None = None
    client_s2a_ms: float | None = None  # true end of speech (client) -> first answer audio received
    client_s2a_minus_hangover_ms: float | None = None
    timeline: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    pause_ms: int | None = None  # the question's mid-sentence pause (None: spoken whole)
    false_endpoint: bool = False  # endpointed or answered before the question's last voiced sample was sent
    responses: int = 0  # response.created received in the turn


@dataclass
class BenchConfig:
    """One run, from the command line."""

    url: str | None = None
    callers: tuple[int, ...] = (1, 4)
    turns: int = 2
    questions: tuple[str, ...] = DEFAULT_QUESTIONS
    max_output_tokens: int | None = None
    chunk_ms: int = 20
    pauses_ms: tuple[int, ...] = (300, 400, 500, 600, 700)
    timeout_s: float = 180.0
    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    server_args: tuple[str, ...] = ()


# ---- spoken questions ------------------------------------------------------------------------------
def speak_questions(texts: tuple[str, ...]) -> list[Question]:
    """Each question spoken by the bundled voice at 24 kHz, after ``LEAD_SILENCE_S`` of silence."""
    from speech.audio import Resampler, to_pcm16
    from speech.config import TTSConfig
    from speech.tts import load_tts

    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    questions = []
    for text in texts:
        speech = tts.synthesize(text).pcm
        if tts.sample_rate != RATE:
            resampler = Resampler(tts.sample_rate, RATE)
            speech = np.concatenate([resampler.process(speech), resampler.flush()])
        audio = np.concatenate([np.zeros(round(LEAD_SILENCE_S * RATE), np.float32), speech])
        questions.append(Question(text, to_pcm16(audio).astype("<i2").tobytes(), speech_end(audio, RATE)))
    return questions


def speak_paused(texts: tuple[str, ...], pauses_ms: tuple[int, ...]) -> list[Question]:
    """Each question cut in two at its middle word, the halves spoken apart, trimmed to their speech
    (-40 dB) and joined by ``pauses_ms[i % len(pauses_ms)]`` of silence, after ``LEAD_SILENCE_S``."""
    from speech.audio import resample, to_pcm16
    from speech.config import TTSConfig
    from speech.tts import load_tts

    tts = load_tts(TTSConfig(backend="hibari", seed=0))

    def say(words: list[str]) -> np.ndarray:
        speech = tts.synthesize(" ".join(words)).pcm
        return speech if tts.sample_rate == RATE else resample(speech, tts.sample_rate, RATE)

    questions = []
    for i, text in enumerate(texts):
        words = text.split()
        halves = [say(words[: len(words) // 2]), say(words[len(words) // 2 :])]
        first, second = (audio[round(start * RATE) : round(end * RATE)] for audio, (start, end) in zip(halves, map(speech_bounds, halves)))
        pause = pauses_ms[i % len(pauses_ms)]
        audio = np.concatenate([np.zeros(round(LEAD_SILENCE_S * RATE), np.float32), first,
                                np.zeros(round(pause * RATE / 1000), np.float32), second])  # fmt: skip
        questions.append(Question(text, to_pcm16(audio).astype("<i2").tobytes(), len(audio) / RATE, pause))
    return questions


def speech_end(audio: np.ndarray, rate: int) -> float:
    """The last instant the 10 ms RMS envelope is within 40 dB of its peak."""
    return speech_bounds(audio, rate)[1]


def speech_bounds(audio: np.ndarray, rate: int = RATE) -> tuple[float, float]:
    """The first and last instants the 10 ms RMS envelope is within 40 dB of its peak."""
    window = rate // 100
    envelope = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(window) / window, "same"))
    loud = np.nonzero(envelope > envelope.max() * 0.01)[0]
    return float(loud[0] / rate), float((loud[-1] + 1) / rate)


# ---- one caller ----------------------------------------------------------------------------------------
async def call(url: str, caller: int, callers: int, questions: list[Question], paused: list[Question], cfg: BenchConfig,
               bar: tqdm) -> list[TurnResult]:  # fmt: skip
    """One caller's session: ask ``cfg.turns`` questions in turn, each after the previous answer;
    every second one (if ``paused``) with a pause in the middle."""
    from websockets.asyncio.client import connect

    results = []
    async with connect(url, max_size=None, open_timeout=60) as ws:
        session = json.loads(await ws.recv())
        hangover = session["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"]
        if cfg.max_output_tokens:
            await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": cfg.max_output_tokens}}))
        for turn in range(cfg.turns):
            if paused and turn % 2:  # the n-th paused question of a caller has the n-th pause of --pause-ms
                question = paused[(caller + turn // 2 * callers) % len(paused)]
            else:
                question = questions[(caller + turn * callers) % len(questions)]
            result = TurnResult(caller, turn, question.text, pause_ms=question.pause_ms)
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    await _turn(ws, question, hangover, result, cfg.chunk_ms)
            except (TimeoutError, OSError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            results.append(result)
            bar.update(1)
    return results


async def microphone(ws: Any, pcm: bytes, chunk_ms: int, stop: asyncio.Event, start: float | None = None) -> None:
    """Stream ``pcm`` (PCM16 at ``RATE``), then silence, in ``chunk_ms`` packets at real-time pace
    from ``start`` (a ``time.perf_counter()`` instant; default now) until ``stop`` is set."""
    chunk = RATE * chunk_ms // 1000 * 2
    silence = bytes(chunk)
    start = time.perf_counter() if start is None else start
    k = 0
    while not stop.is_set():
        piece = pcm[k * chunk : (k + 1) * chunk] or silence
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
        k += 1
        await asyncio.sleep(max(0.0, start + k * chunk_ms / 1000 - time.perf_counter()))


async def _turn(ws: Any, question: Question, hangover_ms: int, result: TurnResult, chunk_ms: int) -> None:
    """Until the timeline of the answer to the whole question: one that was not cancelled, or one
    that came after the question was spoken (an answer to a part cut off by a false endpoint ends
    cancelled when the rest is heard, or before the question has been spoken)."""
    start = time.perf_counter()
    spoken_end = start + question.speech_end_s
    stop_sending = asyncio.Event()
    sender = asyncio.create_task(microphone(ws, question.pcm, chunk_ms, stop_sending, start))
    first_audio: dict[str, float] = {}  # response id -> its first audio received
    transcripts: list[str] = []
    audio_at: float | None = None  # the first audio of the answer whose timeline ends the turn
    try:
        async for message in ws:
            event = json.loads(message)
            kind, now = event["type"], time.perf_counter()
            if kind == "response.output_audio.delta":
                first_audio.setdefault(event["response_id"], now)
            elif kind in ("input_audio_buffer.committed", "response.created"):
                result.false_endpoint |= now < spoken_end
                result.responses += kind == "response.created"
            elif kind == "conversation.item.input_audio_transcription.completed":
                transcripts.append(event["transcript"])
                result.transcript = " ".join(t.strip() for t in transcripts)
                if not result.transcript.strip():
                    result.error = "the question was transcribed as nothing"
                    break
            elif kind == "response.output_audio_transcript.done":
                result.answer = event["transcript"]
            elif kind == "response.done":
                result.status = event["response"]["status"]
            elif kind == "response.timeline" and (result.status != "cancelled" or now > spoken_end):
                result.timeline = event["timeline"]
                audio_at = first_audio.get(event["response_id"])
                break
            elif kind == "error":
                result.error = event["error"]["message"]
    finally:
        stop_sending.set()
        await sender
    result.wer = word_error_rate(question.text, result.transcript)
    if audio_at is not None:
        result.client_s2a_ms = round((audio_at - spoken_end) * 1000, 1)
        result.client_s2a_minus_hangover_ms = round(result.client_s2a_ms - hangover_ms, 1)


async def run_phase(url: str, callers: int, questions: list[Question], paused: list[Question], cfg: BenchConfig) -> list[TurnResult]:
    """``callers`` sessions at once, ``cfg.turns`` turns each."""
    with tqdm(total=callers * cfg.turns, desc=f"{callers} caller(s)", unit="turn", disable=not cfg.progress, file=sys.stderr) as bar:
        per_caller = await asyncio.gather(*(call(url, i, callers, questions, paused, cfg, bar) for i in range(callers)))
    return [r for results in per_caller for r in results]


# ---- summary -------------------------------------------------------------------------------------------
def summarize(results: list[TurnResult]) -> dict[str, dict[str, float]]:
    """p50/p90/p99 (ms) of every stage share and total, over the turns that got a timeline."""
    series: dict[str, list[float]] = {}
    for r in results:
        t = r.timeline
        if not t:
            continue
        for stage, ms in t["stages_ms"].items():
            series.setdefault(stage, []).append(ms)
        for key in ("speech_end_to_first_audio_ms", "endpoint_to_first_audio_ms"):
            if t.get(key) is not None:
                series.setdefault(key.removesuffix("_ms"), []).append(t[key])
        series.setdefault("uncached_prompt_tokens", []).append(t["prompt_tokens"] - t["cached_tokens"])
        for key in ("partials", "prefills"):
            series.setdefault(key, []).append(t[key])
        for key, value in (("client_s2a", r.client_s2a_ms), ("client_s2a_minus_hangover", r.client_s2a_minus_hangover_ms)):
            if value is not None:
                series.setdefault(key, []).append(value)
        if r.wer is not None:
            series.setdefault("transcript_wer_percent", []).append(100 * r.wer)
    return {k: {f"p{round(q * 100)}": round(quantile(v, q), 1) for q in (0.5, 0.9, 0.99)} | {"n": len(v)}
            for k, v in series.items()}  # fmt: skip


def false_endpoints(results: list[TurnResult]) -> dict[str, dict[str, float]]:
    """False endpoints among the questions asked with a pause and among those spoken whole."""
    out = {}
    for kind, turns in (("paused", [r for r in results if r.pause_ms is not None]), ("whole", [r for r in results if r.pause_ms is None])):
        false = sum(r.false_endpoint for r in turns)
        out[kind] = {"false": false, "n": len(turns), "rate": round(false / len(turns), 3) if turns else None}
    return out


def machine() -> dict[str, Any]:
    """Date, CPU, GPU (if torch sees one) and package versions, for the results file."""
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
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu": cpu, "cores": os.cpu_count(),
            "load_average": os.getloadavg(), "platform": platform.platform(), "versions": versions}  # fmt: skip


# ---- the server ------------------------------------------------------------------------------------------
class LocalServer:
    """``python -m assistant serve`` on a free port of 127.0.0.1, its output in a log file."""

    def __init__(self, args: tuple[str, ...]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="assistant-serve-", suffix=".log", delete=False)
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
        """Stop the server; its log is deleted unless ``keep_log`` (a failed run)."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if keep_log:
            print(f"the server's log: {self.log.name}", file=sys.stderr)
        else:
            os.unlink(self.log.name)


async def run(cfg: BenchConfig) -> dict[str, Any]:
    """Every phase against ``cfg.url`` (or a server of our own); returns the report."""
    print(f"Speaking {len(cfg.questions)} questions with the bundled voice...", file=sys.stderr, flush=True)
    questions = speak_questions(cfg.questions)
    paused = speak_paused(cfg.questions, cfg.pauses_ms) if cfg.pauses_ms and cfg.turns > 1 else []
    for q in paused:
        print(f"  with a {q.pause_ms} ms pause: {q.text}", file=sys.stderr)
    server = None
    url = cfg.url
    if url is None:
        print("Starting the server (python -m assistant serve)...", file=sys.stderr, flush=True)
        server = LocalServer(cfg.server_args)
        url = server.url
    ok = False
    try:
        if server is not None:
            await asyncio.to_thread(server.wait_ready)
        phases = []
        for n in cfg.callers:
            results = await run_phase(url, n, questions, paused, cfg)
            phases.append({"callers": n, "summary": summarize(results), "false_endpoints": false_endpoints(results),
                           "turns": [asdict(r) for r in results]})  # fmt: skip
        ok = all(not r["error"] and r["timeline"] for p in phases for r in p["turns"])
    finally:
        if server is not None:
            server.stop(keep_log=not ok)
    return {"meta": {**machine(), "command": " ".join(["python -m assistant.bench", *sys.argv[1:]]), "url": cfg.url or "own server",
                     "server_args": list(cfg.server_args), "chunk_ms": cfg.chunk_ms, "turns_per_caller": cfg.turns,
                     "pauses_ms": list(cfg.pauses_ms)},
            "phases": phases}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python -m assistant.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", help="ws://HOST:PORT/v1/realtime of a running server (default: start one)")
    p.add_argument("--callers", type=int, nargs="+", default=[1, 4], help="concurrent callers per phase (default: 1 4)")
    p.add_argument("--turns", type=int, default=2, help="questions per caller (default 2)")
    p.add_argument("--questions", type=Path, help="JSON list of questions (strings or {question_en: ...}) or a text file, one per line")
    p.add_argument("--max-output-tokens", type=int, help="cap each answer (session.update)")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio packet length, sent at real-time pace (default 20)")
    p.add_argument("--pause-ms", type=int, nargs="*", default=[300, 400, 500, 600, 700],
                   help="mid-sentence pauses of the questions asked every second turn, in turn (default 300 400 500 600 700; "
                        "none given: no pauses)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a turn may take (default 180)")
    p.add_argument("--json", type=Path, help="write the whole report here")
    p.add_argument("--plot", type=Path, help="write the waterfall PNG here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    add_server_options(p, "the bench")
    a = p.parse_args(argv)
    if a.turns < 1 or min(a.callers) < 1 or a.chunk_ms < 10:
        p.error("--turns and --callers must be >= 1, --chunk-ms >= 10")
    server_args = chosen_server_args(a)
    if a.url and server_args:
        p.error("server options only apply when the bench starts its own server (no --url)")
    return BenchConfig(
        url=a.url, callers=tuple(a.callers), turns=a.turns, questions=load_questions(a.questions) if a.questions else DEFAULT_QUESTIONS,
        max_output_tokens=a.max_output_tokens, chunk_ms=a.chunk_ms, pauses_ms=tuple(a.pause_ms), timeout_s=a.timeout, json_path=a.json,
        plot_path=a.plot, progress=a.progress, server_args=server_args,
    )  # fmt: skip


SERVER_OPTIONS = ("docs", "model", "asr", "lang", "max_tokens", "max_sessions", "max_sessions_per_client", "hangover_ms",
                  "output_lead_ms", "device", "quantization", "endpointing", "speculative_pause_ms")  # fmt: skip


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
    failed = [t for p in report["phases"] for t in p["turns"] if t["error"] or not t["timeline"]]
    if failed:
        print(f"{len(failed)} turn(s) failed, e.g.: {failed[0]['error']}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
