"""The soak's clients: what one session does, turn by turn, and the tally of what came of it.

Each worker of ``python -m assistant.soak`` runs :data:`EPISODES` in turn (starting at its own
index, so even a short run mixes them). A Realtime episode is one WebSocket session and a few
actions; an HTTP episode is a few chat requests. Actions are clean turns (spoken questions streamed
at real-time pace, typed questions answered in text or audio, HTTP chats) and faults: disconnects
mid-answer (close frame or the TCP connection dropped), garbage events while an answer streams
(malformed JSON, unknown event types, invalid fields: each must get an ``error`` event), and
barge-ins (a spoken question over the answer).

Every turn that should end in ``response.done`` (or an HTTP answer) is recorded as completed,
cancelled by the soak itself (a disconnect or barge-in it caused), unheard (the spoken question was
transcribed as nothing, so by design there is no answer) or lost, with the reason.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from assistant.bench_callers import Question, microphone

# One Realtime session per tuple (the last action may end it), or HTTP chats ("http*" only).
EPISODES: tuple[tuple[str, ...], ...] = (
    ("voice", "text_audio", "close"),
    ("garbage", "voice", "drop_mid_answer"),
    ("barge_in", "text", "close_mid_answer"),
    ("http", "http_stream", "http_drop_mid_answer"),
    ("text", "voice", "drop_mid_voice_answer"),
)
# Invalid client events that already get an ``error`` event (code expected for each).
GARBAGE: tuple[tuple[str, str], ...] = (
    ('{"type": "response.create", ', "invalid_json"),
    ("not json at all", "invalid_json"),
    ('{"type": "soak.no_such_event"}', "unknown_event_type"),
    ('{"type": "session.update", "session": {"max_output_tokens": 0}}', "invalid_value"),
    ('{"type": "response.create", "response": {"soak_field": 1}}', "unknown_parameter"),
    ('{"type": "input_audio_buffer.append", "audio": "@@not base64@@"}', "invalid_base64"),
    ('["an", "array"]', "invalid_event"),
    ('{"type": "conversation.item.create"}', "missing_required_parameter"),
)
DONE_OK = ("completed", "incomplete")


@dataclass
class Tally:
    """Everything the soak's clients saw; shared by all workers (one event loop, no locks needed)."""

    outcomes: Counter[str] = field(default_factory=Counter)  # completed | cancelled | unheard | lost
    lost: list[str] = field(default_factory=list)  # why each lost turn was lost
    faults: Counter[str] = field(default_factory=Counter)  # injected, by kind
    errors: Counter[str] = field(default_factory=Counter)  # error events / HTTP errors by code
    unexpected: list[str] = field(default_factory=list)  # errors the soak did not provoke
    garbage_sent: int = 0
    garbage_answered: int = 0
    sessions: int = 0
    refused: int = 0  # connections refused at the session limit (1013), retried

    @property
    def attempted(self) -> int:
        return sum(self.outcomes.values())

    def turn(self, outcome: str, why: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome == "lost":
            self.lost.append(why)

    def error(self, code: str, detail: str, expected: bool) -> None:
        self.errors[code] += 1
        if not expected:
            self.unexpected.append(f"{code}: {detail}"[:300])


@dataclass(frozen=True)
class Plan:
    """What the workers share: where the server is, the spoken questions, the limits of a turn."""

    ws_url: str
    http_url: str
    model: str
    questions: list[Question]
    texts: tuple[str, ...]
    max_output_tokens: int
    chunk_ms: int
    turn_timeout_s: float


class Caller:
    """One worker: episodes in turn until ``deadline`` (a ``time.monotonic()`` instant)."""

    def __init__(self, index: int, plan: Plan, tally: Tally, http: httpx.AsyncClient) -> None:
        self.index = index
        self.plan = plan
        self.tally = tally
        self.client = http
        self.rng = random.Random(index)
        self.garbage_pending: list[str] = []  # the error codes the garbage sent so far should get

    async def run(self, deadline: float) -> None:
        k = self.index
        while time.monotonic() < deadline:
            try:
                await self.episode(EPISODES[k % len(EPISODES)], deadline)
            except Exception as exc:  # a soak client's own bug: counted and shown, the soak goes on
                self.tally.error("client_exception", f"{EPISODES[k % len(EPISODES)]}: {exc!r}", expected=False)
            k += 1

    async def warm_up(self) -> None:
        """One clean turn: spoken for even workers, typed for odd ones."""
        await self.episode(("voice",) if self.index % 2 == 0 else ("text_audio",), deadline=float("inf"))

    async def episode(self, actions: tuple[str, ...], deadline: float) -> None:
        if actions[0].startswith("http"):
            for action in actions:
                if time.monotonic() >= deadline:
                    return
                await getattr(self, action)()
            return
        ws = await self.open()
        if ws is None:
            return
        try:
            for action in actions:
                if time.monotonic() >= deadline and action != "close":
                    continue
                await getattr(self, action)(ws)
        except ConnectionClosed as exc:
            self.tally.error("connection_closed", f"the server closed the session: {exc}", expected=False)
        except TimeoutError:
            self.tally.turn("lost", f"{actions}: no answer started in {self.plan.turn_timeout_s:.0f} s")
        finally:
            await ws.close()

    async def open(self) -> ClientConnection | None:
        """A new session (``max_output_tokens`` set), retried while the server is at its session limit."""
        for _ in range(60):
            try:
                ws = await connect(self.plan.ws_url, max_size=None, open_timeout=60)
                first = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if first["type"] == "session.created":
                    break
                code = first.get("error", {}).get("code")
                await ws.close()
                if code != "session_limit_reached":
                    self.tally.error(code or first["type"], "instead of session.created", expected=False)
                    return None
                self.tally.refused += 1
            except (OSError, TimeoutError, InvalidStatus, ConnectionClosed) as exc:
                self.tally.error("connect_failed", f"{type(exc).__name__}: {exc}", expected=False)
            await asyncio.sleep(1.0)
        else:
            return None
        self.tally.sessions += 1
        await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": self.plan.max_output_tokens}}))
        await self.until(ws, lambda e: e["type"] == "session.updated")
        return ws

    # ---- reading events ----------------------------------------------------------------------------
    async def until(self, ws: ClientConnection, stop: Callable[[dict[str, Any]], bool], timeout: float | None = None) -> list[dict[str, Any]]:
        """Server events up to and including the first that ``stop`` accepts (within ``timeout``, by
        default a turn's); every ``error`` is tallied."""
        events = []
        async with asyncio.timeout(timeout or self.plan.turn_timeout_s):
            while True:
                event = json.loads(await ws.recv())
                events.append(event)
                if event["type"] == "error":
                    err = event["error"]
                    expected = err.get("code") in self.garbage_pending
                    if expected:
                        self.garbage_pending.remove(err["code"])
                        self.tally.garbage_answered += 1
                    self.tally.error(err.get("code") or "none", err.get("message", ""), expected)
                if stop(event):
                    return events

    async def answer(self, ws: ClientConnection, response_id: str | None, what: str) -> str | None:
        """Wait for the ``response.done`` of ``response_id`` (None: the next one) and record the turn;
        returns the status, or None when the turn was lost."""
        def done(e: dict[str, Any]) -> bool:
            return e["type"] == "response.done" and response_id in (None, e["response"]["id"])

        try:
            events = await self.until(ws, done, self.plan.turn_timeout_s)
        except TimeoutError:
            self.tally.turn("lost", f"{what}: no response.done in {self.plan.turn_timeout_s:.0f} s")
            return None
        except ConnectionClosed as exc:
            self.tally.turn("lost", f"{what}: the connection closed ({exc})")
            raise
        response = events[-1]["response"]
        if response["status"] in DONE_OK:
            self.tally.turn("completed")
        elif response["status"] == "cancelled":
            self.tally.turn("lost", f"{what}: cancelled by the server ({response['status_details']})")
        else:
            self.tally.turn("lost", f"{what}: {response['status']} ({response['status_details']})")
        return response["status"]

    # ---- Realtime actions --------------------------------------------------------------------------
    def question(self) -> Question:
        return self.rng.choice(self.plan.questions)

    async def ask(self, ws: ClientConnection, modality: str) -> None:
        text = self.rng.choice(self.plan.texts)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": [modality]}}))

    async def text(self, ws: ClientConnection) -> None:
        await self.ask(ws, "text")
        await self.answer(ws, None, "typed question, text answer")

    async def text_audio(self, ws: ClientConnection) -> None:
        await self.ask(ws, "audio")
        await self.answer(ws, None, "typed question, spoken answer")

    async def voice(self, ws: ClientConnection) -> None:
        """A spoken question, then silence like an open microphone, until its answer is done."""
        stop = asyncio.Event()
        mic = asyncio.create_task(microphone(ws, self.question().pcm, self.plan.chunk_ms, stop))
        try:
            await self.heard_and_answered(ws, "spoken question")
        finally:
            stop.set()
            await asyncio.gather(mic, return_exceptions=True)

    async def heard_and_answered(self, ws: ClientConnection, what: str) -> None:
        """The transcript of the next utterance, then its answer (an empty transcript has none)."""
        def heard(e: dict[str, Any]) -> bool:
            return e["type"] in ("conversation.item.input_audio_transcription.completed",
                                 "conversation.item.input_audio_transcription.failed", "response.created")  # fmt: skip

        try:
            event = (await self.until(ws, heard, self.plan.turn_timeout_s))[-1]
        except TimeoutError:
            self.tally.turn("lost", f"{what}: not transcribed in {self.plan.turn_timeout_s:.0f} s")
            return
        if event["type"].endswith(".failed"):
            self.tally.turn("lost", f"{what}: transcription failed ({event['error']})")
            return
        if event["type"].endswith(".completed") and not event["transcript"].strip():
            self.tally.turn("unheard")
            self.tally.error("transcribed_as_nothing", what, expected=False)
            return
        await self.answer(ws, event["response"]["id"] if event["type"] == "response.created" else None, what)

    async def garbage(self, ws: ClientConnection) -> None:
        """Invalid events while a typed question is answered: each gets an ``error``, the answer goes on."""
        await self.ask(ws, self.rng.choice(("text", "audio")))
        created = (await self.until(ws, lambda e: e["type"] == "response.created"))[-1]
        sent = self.rng.sample(GARBAGE, 4)
        self.garbage_pending += [code for _, code in sent]
        for raw, _ in sent:
            await ws.send(raw)
        self.tally.garbage_sent += len(sent)
        self.tally.faults["garbage event"] += len(sent)
        await self.answer(ws, created["response"]["id"], "typed question with garbage events")
        if self.garbage_pending:  # the errors may follow the answer; a clean event proves the session lives
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await self.until(ws, lambda e: e["type"] == "input_audio_buffer.cleared")
            if self.garbage_pending:
                self.tally.error("garbage_unanswered", f"no error event for {self.garbage_pending}", expected=False)
                self.garbage_pending = []

    async def barge_in(self, ws: ClientConnection) -> None:
        """A spoken question over a spoken answer: the answer is cancelled and the question answered."""
        await self.ask(ws, "audio")
        events = await self.until(ws, lambda e: e["type"] == "response.output_audio.delta", self.plan.turn_timeout_s)
        first = next(e["response"]["id"] for e in events if e["type"] == "response.created")
        self.tally.faults["barge-in"] += 1
        stop = asyncio.Event()
        mic = asyncio.create_task(microphone(ws, self.question().pcm, self.plan.chunk_ms, stop))
        try:
            done = (await self.until(ws, lambda e: e["type"] == "response.done" and e["response"]["id"] == first,
                                     self.plan.turn_timeout_s))[-1]  # fmt: skip
            status = done["response"]["status"]
            self.tally.turn("cancelled" if status == "cancelled" else "completed" if status in DONE_OK else "lost",
                            f"answer talked over: {status}")  # fmt: skip
            await self.heard_and_answered(ws, "spoken question over an answer")
        finally:
            stop.set()
            await asyncio.gather(mic, return_exceptions=True)

    async def close(self, ws: ClientConnection) -> None:
        await ws.close()

    async def close_mid_answer(self, ws: ClientConnection) -> None:
        await self.leave_mid_answer(ws, drop=False, spoken=False)

    async def drop_mid_answer(self, ws: ClientConnection) -> None:
        await self.leave_mid_answer(ws, drop=True, spoken=False)

    async def drop_mid_voice_answer(self, ws: ClientConnection) -> None:
        await self.leave_mid_answer(ws, drop=True, spoken=True)

    async def leave_mid_answer(self, ws: ClientConnection, drop: bool, spoken: bool) -> None:
        """Leave once the answer streams: a close frame, or the TCP connection dropped without one."""
        stop = asyncio.Event()
        mic = None
        if spoken:
            mic = asyncio.create_task(microphone(ws, self.question().pcm, self.plan.chunk_ms, stop))
        else:
            await self.ask(ws, self.rng.choice(("text", "audio")))
        def started(e: dict[str, Any]) -> bool:
            return e["type"] in ("response.output_text.delta", "response.output_audio.delta") or (
                e["type"] == "conversation.item.input_audio_transcription.completed" and not e["transcript"].strip())

        try:
            event = (await self.until(ws, started, self.plan.turn_timeout_s))[-1]
        except TimeoutError:
            self.tally.turn("lost", "question left mid-answer: no answer started")
            return
        finally:
            stop.set()
            if mic is not None:
                await asyncio.gather(mic, return_exceptions=True)
        if event["type"].endswith(".completed"):
            self.tally.turn("unheard")
            self.tally.error("transcribed_as_nothing", "spoken question left mid-answer", expected=False)
            return
        self.tally.turn("cancelled")
        self.tally.faults["dropped connection mid-answer" if drop else "closed mid-answer"] += 1
        if drop:
            ws.transport.abort()
        else:
            await ws.close()

    # ---- HTTP actions ------------------------------------------------------------------------------
    def chat_body(self, stream: bool) -> dict[str, Any]:
        return {"model": self.plan.model, "messages": [{"role": "user", "content": self.rng.choice(self.plan.texts)}],
                "max_tokens": self.plan.max_output_tokens, "stream": stream}  # fmt: skip

    async def http(self) -> None:
        try:
            r = await self.client.post(self.plan.http_url + "/v1/chat/completions", json=self.chat_body(False),
                                     timeout=self.plan.turn_timeout_s)  # fmt: skip
        except httpx.HTTPError as exc:
            self.tally.turn("lost", f"HTTP chat: {type(exc).__name__}: {exc}")
            return
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
            self.tally.turn("completed")
        else:
            self.tally.error(f"http_{r.status_code}", r.text, expected=False)
            self.tally.turn("lost", f"HTTP chat: {r.status_code} {r.text[:200]}")

    async def http_stream(self, leave_early: bool = False) -> None:
        what = "HTTP chat stream"
        try:
            async with self.client.stream("POST", self.plan.http_url + "/v1/chat/completions", json=self.chat_body(True),
                                        timeout=self.plan.turn_timeout_s) as r:  # fmt: skip
                if r.status_code != 200:
                    body = (await r.aread()).decode(errors="replace")
                    self.tally.error(f"http_{r.status_code}", body, expected=False)
                    self.tally.turn("lost", f"{what}: {r.status_code} {body[:200]}")
                    return
                async for line in r.aiter_lines():
                    if leave_early and line.startswith("data: {") and '"content"' in line:
                        self.tally.turn("cancelled")
                        self.tally.faults["HTTP stream left mid-answer"] += 1
                        return  # leaving the block closes the connection
                    if line == "data: [DONE]":
                        self.tally.turn("completed")
                        return
                    if line.startswith("data: ") and '"error"' in line:
                        self.tally.error("stream_error", line, expected=False)
        except httpx.HTTPError as exc:
            self.tally.turn("lost", f"{what}: {type(exc).__name__}: {exc}")
            return
        self.tally.turn("lost", f"{what}: the stream ended without [DONE]")

    async def http_drop_mid_answer(self) -> None:
        await self.http_stream(leave_early=True)


__all__ = ["EPISODES", "GARBAGE", "Caller", "Plan", "Tally"]
