"""The voice bench's callers: spoken questions, and what one caller does over ``/v1/realtime``.

Two patterns (:class:`Pattern`):
- conversation: each caller connects, waits a random 0 to ``pause_s[1]`` seconds (so the callers'
  questions spread over time instead of all starting at once), speaks a question at real-time
  pace, keeps streaming silence like an open microphone until the spoken answer is done, pauses a
  random ``pause_s`` (1-3 s by default, seeded per caller) with the microphone still streaming
  silence, then asks the next question; it stops after ``turns`` questions or once ``duration_s``
  has passed since the phase started (a turn under way is finished).
- burst: every caller connects, then all speak their one question at the same instant.

In a conversation every second turn of a caller (turns 1, 3, ...) asks its question with a
mid-sentence pause (``Pattern.pauses_ms``, 300-700 ms in turn): its two halves are synthesized
apart, trimmed to their speech and joined with that much silence. A false endpoint is the server
endpointing (``input_audio_buffer.committed``) or answering (``response.created``) before the
question's last voiced sample was sent; a turn cut that way ends with the answer to its last part,
and its transcript is every part heard.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from speech.word_errors import word_error_rate

RATE = 24000
LEAD_SILENCE_S = 0.3


@dataclass(frozen=True)
class Question:
    """A spoken question: PCM16 at 24 kHz with lead silence, and where its speech ends."""

    text: str
    pcm: bytes
    speech_end_s: float
    pause_ms: int | None = None  # silence in the middle (None: spoken whole)


@dataclass(frozen=True)
class Pattern:
    """How callers space their questions (see the module docstring)."""

    burst: bool = False
    turns: int = 2  # questions per caller (a burst asks one)
    duration_s: float | None = None  # no new question after this long into the phase
    pause_s: tuple[float, float] = (1.0, 3.0)
    seed: int = 0
    chunk_ms: int = 20
    timeout_s: float = 180.0  # the longest one turn may take
    max_output_tokens: int | None = None
    pauses_ms: tuple[int, ...] = (300, 400, 500, 600, 700)  # mid-sentence pauses of every second turn (): none

    @property
    def name(self) -> str:
        return "burst" if self.burst else "conversation"


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
    client_pid: int = field(default_factory=os.getpid)  # the client process that ran the caller

    @property
    def lost(self) -> bool:
        """No answer audio or no timeline came back for this turn."""
        return bool(self.error) or not self.timeline or self.client_s2a_ms is None


# ---- spoken questions ------------------------------------------------------------------------------
def speak_questions(texts: tuple[str, ...]) -> list[Question]:
    """Each question spoken by the bundled voice at 24 kHz, after ``LEAD_SILENCE_S`` of silence."""
    from speech.audio import Resampler, to_pcm16
    from speech.config import TTSConfig
    from speech.tts import load_tts

    tts = load_tts(TTSConfig(backend="hibari", seed=0, workers=1))
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

    tts = load_tts(TTSConfig(backend="hibari", seed=0, workers=1))

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
@dataclass
class _Start:
    """One event loop's callers: ``connected`` counts them in; ``all_connected`` is set once all
    ``local`` have connected (or failed to), ``go`` once every caller of the phase has."""

    local: int
    go: asyncio.Event = field(default_factory=asyncio.Event)
    all_connected: asyncio.Event = field(default_factory=asyncio.Event)
    connected: int = 0


async def call(url: str, caller: int, callers: int, questions: list[Question], paused: list[Question], pattern: Pattern,
               start: _Start, turn_done: Callable[[], None]) -> list[TurnResult]:  # fmt: skip
    """One caller's session: connect, wait for ``start.go`` (every caller connected), then its turns;
    in a conversation every second one (if ``paused``) with a pause in the middle."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    rng = random.Random(f"{pattern.seed}-{callers}-{caller}")
    results = []
    go = start.go
    try:
        ws = await connect(url, max_size=None, open_timeout=120)
    finally:  # a caller that cannot connect fails the phase; it must not hold the others at ``go``
        start.connected += 1
        if start.connected == start.local:
            start.all_connected.set()
    async with ws:
        session = json.loads(await ws.recv())
        if session.get("type") != "session.created":  # refused (e.g. at the session limit): one lost turn, said why
            await go.wait()
            return [TurnResult(caller, 0, "", error=f"refused: {session.get('error', session)}")]
        hangover = session["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"]
        if pattern.max_output_tokens:
            await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": pattern.max_output_tokens}}))
        await go.wait()
        start = time.perf_counter()
        if not pattern.burst:
            await _silence(ws, rng.uniform(0.0, pattern.pause_s[1]), pattern.chunk_ms)
        for turn in range(1 if pattern.burst else pattern.turns):
            if turn and pattern.duration_s is not None and time.perf_counter() - start >= pattern.duration_s:
                break
            if paused and turn % 2 and not pattern.burst:  # a caller's n-th paused question has the n-th pause
                question = paused[(caller + turn // 2 * callers) % len(paused)]
            else:
                question = questions[(caller + turn * callers) % len(questions)]
            result = TurnResult(caller, turn, question.text, pause_ms=question.pause_ms)
            try:
                if turn:
                    await _silence(ws, rng.uniform(*pattern.pause_s), pattern.chunk_ms)
                async with asyncio.timeout(pattern.timeout_s):
                    await _turn(ws, question, hangover, result, pattern.chunk_ms)
            except (TimeoutError, OSError, ConnectionClosed) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            results.append(result)
            turn_done()
            if isinstance(ws.close_code, int):  # the server closed the session: this caller is done
                break
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


async def _silence(ws: Any, seconds: float, chunk_ms: int) -> None:
    """An open microphone in a pause: silence at real-time pace for ``seconds``."""
    stop = asyncio.Event()
    mic = asyncio.create_task(microphone(ws, b"", chunk_ms, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await mic


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


async def run_phase(url: str, callers: int, questions: list[Question], paused: list[Question], pattern: Pattern,
                    progress: bool, processes: int = 1) -> list[TurnResult]:  # fmt: skip
    """``callers`` sessions at once in ``pattern``; every turn's result.

    With ``processes`` > 1 the callers are spread over that many client processes (caller ``i`` in
    process ``i % processes``, with the questions and pauses it would have in one), so that one
    client event loop, sending every caller's audio in real time, is not what limits a run of many
    callers; all callers still start together (a barrier across the processes).
    """
    total = callers * (1 if pattern.burst else pattern.turns)
    processes = max(1, min(processes, callers))
    with tqdm(total=total, desc=f"{callers} caller(s), {pattern.name}", unit="turn", disable=not progress, file=sys.stderr) as bar:
        if processes == 1:
            return await _callers(url, list(range(callers)), callers, questions, paused, pattern, lambda: bar.update(1))
        return await asyncio.to_thread(_in_processes, url, callers, questions, paused, pattern, processes, bar)


async def _callers(url: str, indices: list[int], callers: int, questions: list[Question], paused: list[Question], pattern: Pattern,
                   turn_done: Callable[[], None], barrier: Any = None) -> list[TurnResult]:  # fmt: skip
    """The callers ``indices`` of a phase of ``callers``, on this event loop; with ``barrier``
    (a multiprocessing.Barrier) they start once every process's callers have connected."""
    start = _Start(local=len(indices))

    async def gate() -> None:
        await start.all_connected.wait()
        if barrier is not None:
            try:
                await asyncio.to_thread(barrier.wait)
            except threading.BrokenBarrierError:  # another process failed to start: go on, its callers report it
                pass
        start.go.set()

    gating = asyncio.create_task(gate())
    per_caller = await asyncio.gather(*(call(url, i, callers, questions, paused, pattern, start, turn_done) for i in indices))
    await gating
    return [r for results in per_caller for r in results]


def _client_process(url: str, indices: list[int], callers: int, questions: list[Question], paused: list[Question],
                    pattern: Pattern, barrier: Any, events: Any) -> None:  # fmt: skip
    """A client process: its callers on its own event loop; a ``None`` per finished turn, then the results."""
    events.put(asyncio.run(_callers(url, indices, callers, questions, paused, pattern, lambda: events.put(None), barrier)))


def _in_processes(url: str, callers: int, questions: list[Question], paused: list[Question], pattern: Pattern,
                  processes: int, bar: tqdm) -> list[TurnResult]:  # fmt: skip
    """Run a phase's callers in ``processes`` client processes (spawned: no state of this one is shared)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, events = ctx.Barrier(processes, timeout=300), ctx.Queue()
    workers = [ctx.Process(target=_client_process, daemon=True, name=f"bench-callers-{k}",
                           args=(url, list(range(k, callers, processes)), callers, questions, paused, pattern, barrier, events))
               for k in range(processes)]  # fmt: skip
    for worker in workers:
        worker.start()
    results: list[TurnResult] = []
    finished = 0
    try:
        while finished < processes:
            try:
                item = events.get(timeout=5)
            except queue.Empty:
                dead = [w.name for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"client process(es) {', '.join(dead)} died; their callers' turns are lost") from None
                continue
            if item is None:
                bar.update(1)
            else:
                results += item
                finished += 1
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    return sorted(results, key=lambda r: (r.caller, r.turn))


__all__ = ["LEAD_SILENCE_S", "RATE", "Pattern", "Question", "TurnResult", "call", "microphone", "run_phase", "speak_paused",
           "speak_questions", "speech_bounds", "speech_end"]  # fmt: skip
