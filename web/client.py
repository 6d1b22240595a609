"""One page's Realtime session: a WebSocket client of the assistant's ``/v1/realtime``.

:class:`RealtimeClient` sends the page's microphone audio, typed questions and settings as
client events, and folds the server events into what the page shows: the conversation as
:class:`Turn` objects (question, streamed answer, status, per-stage timeline), the answer audio of
each spoken reply (:class:`AnswerAudio`), what the assistant is doing now, and the server's
``error`` messages. Waiters (the page's update loop, the audio player) wake on every change.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
COMMIT_TIMEOUT_S = 10.0
TRANSCRIPT_TIMEOUT_S = 60.0
MAX_QUIET = 64  # requests whose expected error codes are remembered (an error comes back within ms)


class SessionError(RuntimeError):
    """The session cannot be opened or is gone; the message says why."""


@dataclass
class Turn:
    """One exchange as the page shows it: the question (spoken or typed) and the answer to it."""

    spoken: bool
    question: str = ""
    heard: bool = False  # the question is final (typed, or its transcript is complete)
    item_id: str | None = None
    answer: str = ""
    response_id: str | None = None
    status: str | None = None  # None while answering; then completed | incomplete | cancelled | failed
    detail: str | None = None  # why it was cancelled/cut, or what failed
    timeline: dict[str, Any] | None = None  # the ``response.timeline`` report
    citation: str | None = None  # the handbook section the answer is attributed to (same event)
    picture: str | None = None  # the file of the picture asked about, shown in the conversation


@dataclass
class AnswerAudio:
    """The PCM16 chunks of one spoken answer, as they arrive."""

    response_id: str
    chunks: list[bytes] = field(default_factory=list)
    done: bool = False
    cut: bool = False  # the answer was interrupted: what is left is not to be played


class RealtimeClient:
    """A Realtime API session seen from the page. Create with :meth:`open`, end with :meth:`close`."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self.session: dict[str, Any] = {}  # the server's view of the session settings
        self.turns: list[Turn] = []
        self.audio: dict[str, AnswerAudio] = {}
        self.audio_replies: list[str] = []  # response ids of spoken answers, in order
        self._speaking = False  # between speech_started and the end of that utterance
        self.errors: list[str] = []  # server error messages not yet shown
        self.closed_reason: str | None = None
        self._quiet: dict[str, tuple[str, ...]] = {}  # event id -> error codes the caller expects
        self._refused: set[str] = set()  # event ids the server answered with an error
        self._commits = 0  # input_audio_buffer.committed events so far
        self._version = 0
        self._changed = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, url: str, api_key: str | None = None) -> RealtimeClient:
        """Connect to ``url`` (``ws://.../v1/realtime``, with the server's API key if it has one)
        and wait for ``session.created``."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            ws = await asyncio.wait_for(connect(url, max_size=None, additional_headers=headers), CONNECT_TIMEOUT_S)
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise SessionError(f"cannot reach the assistant at {url}: {exc}") from exc
        client = cls(ws)
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), CONNECT_TIMEOUT_S))
        except (ConnectionClosed, TimeoutError) as exc:
            await ws.close()
            raise SessionError(f"the assistant did not open a session: {exc}") from exc
        if first.get("type") != "session.created":
            await ws.close()
            message = first.get("error", {}).get("message") if first.get("type") == "error" else first.get("type")
            raise SessionError(f"the assistant refused the session: {message}")
        client.session = first["session"]
        client._reader = asyncio.create_task(client._read(), name="realtime-client")
        return client

    # ---- what the page reads ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    @property
    def answering(self) -> bool:
        """A response was created and is not done."""
        return any(t.response_id is not None and t.status is None for t in self.turns)

    @property
    def activity(self) -> str:
        """What the assistant does now: "hearing" (the user speaks), "thinking" (from the end of
        speech to the answer's first words), "answering", or "idle"."""
        if self._speaking:
            return "hearing"
        transcribing = any(t.spoken and not t.heard for t in self.turns)
        if transcribing or any(t.response_id and t.status is None and not t.answer for t in self.turns):
            return "thinking"
        return "answering" if self.answering else "idle"

    @property
    def hands_free(self) -> bool:
        """The server's VAD ends turns and answers them (else: push to talk, the page ends turns)."""
        return self.session["audio"]["input"]["turn_detection"] is not None

    @property
    def input_rate(self) -> int:
        """The sample rate of the audio the session takes (PCM16 mono)."""
        return int(self.session["audio"]["input"]["format"]["rate"])

    @property
    def output_rate(self) -> int:
        """The sample rate of the answer audio (PCM16 mono)."""
        return int(self.session["audio"]["output"]["format"]["rate"])

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

    async def wait(self, version: int, timeout: float) -> int:
        """Until something changed since ``version`` (or ``timeout`` s passed); the version now,
        which grows with every change (a server event received, a question typed)."""
        await self._until(lambda: self._version != version, timeout)
        return self._version

    async def answer_audio(self, response_id: str, min_samples: int) -> AsyncIterator[bytes]:
        """The answer's audio as it arrives, in pieces of at least ``min_samples`` (the last may be
        shorter); ends when the answer is done, at once when it is interrupted. Nothing for an
        answer that was done before the next spoken answer began: only the newest is kept."""
        audio = self.audio.get(response_id)
        if audio is None:  # an earlier answer whose audio was already let go
            return
        sent = 0
        while True:
            await self._until(lambda sent=sent: audio.done or sum(map(len, audio.chunks[sent:])) >= 2 * min_samples)
            if audio.cut or self.closed:
                return
            if len(audio.chunks) > sent:
                piece, sent = b"".join(audio.chunks[sent:]), len(audio.chunks)
                yield piece
            if audio.done:
                return

    # ---- what the page sends ---------------------------------------------------------------------
    async def append_audio(self, pcm16: bytes) -> None:
        """Microphone audio: PCM16 mono at the session rate."""
        await self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})

    async def ask(self, text: str, image_url: str | None = None, picture: str | None = None) -> None:
        """A typed question, answered in text, about a picture if ``image_url`` (a data URL; ``picture``
        is its file, for the conversation); an answer still in progress is stopped first."""
        await self.interrupt()
        self.turns.append(Turn(spoken=False, question=text, heard=True, picture=picture))
        await self._touch()
        content: list[dict[str, str]] = [{"type": "input_text", "text": text}] if text else []
        if image_url is not None:
            content.append({"type": "input_image", "image_url": image_url})
        await self._send({"type": "conversation.item.create",
                          "item": {"type": "message", "role": "user", "content": content}})  # fmt: skip
        await self._send({"type": "response.create", "response": {"output_modalities": ["text"]}})

    async def interrupt(self) -> None:
        """Stop the answer in progress, if any (the stop button, or pressing to talk over it)."""
        if self.answering:
            await self._send({"type": "response.cancel"}, quiet=("response_cancel_not_active",))

    async def update(self, session: dict[str, Any]) -> None:
        """Change session settings (``session.update``); the server answers ``session.updated`` or ``error``."""
        await self._send({"type": "session.update", "session": {"type": "realtime", **session}})

    async def finish_turn(self) -> bool:
        """Push-to-talk release: end the utterance now, wait for its transcript, then ask for the
        answer. False if no question was heard (nothing is asked then)."""
        commits = self._commits
        event_id = await self._send({"type": "input_audio_buffer.commit"}, quiet=("input_audio_buffer_commit_empty",))
        await self._until(lambda: self._commits > commits or event_id in self._refused, COMMIT_TIMEOUT_S)
        await self._until(lambda: all(t.heard for t in self.turns if t.spoken), TRANSCRIPT_TIMEOUT_S)
        last = next((t for t in reversed(self.turns) if t.spoken), None)
        if last is None or last.response_id is not None or not last.question:
            return False
        await self._send({"type": "response.create"})
        return True

    async def close(self) -> None:
        """Leave the session (the server aborts an answer in flight)."""
        self.closed_reason = self.closed_reason or "the page closed the session"
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._ws.close()

    # ---- internals -------------------------------------------------------------------------------
    async def _send(self, event: dict[str, Any], quiet: tuple[str, ...] = ()) -> str:
        if self.closed:
            raise SessionError(f"the session with the assistant has ended ({self.closed_reason}); reload the page")
        event_id = f"evt_{uuid.uuid4().hex[:16]}"
        if quiet:
            self._quiet[event_id] = quiet
            while len(self._quiet) > MAX_QUIET:  # the oldest were answered without an error long ago
                self._quiet.pop(next(iter(self._quiet)))
        try:
            await self._ws.send(json.dumps({**event, "event_id": event_id}))
        except ConnectionClosed as exc:
            raise SessionError(f"the session with the assistant has ended ({exc}); reload the page") from exc
        return event_id

    async def _until(self, condition: Callable[[], bool], timeout: float | None = None) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: condition() or self.closed), timeout)
            except TimeoutError:
                pass

    async def _touch(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                self._apply(json.loads(message))
                await self._touch()
        except ConnectionClosed as exc:
            self.closed_reason = f"connection closed: {exc}"
        except Exception as exc:  # a bug here must not leave the page waiting forever
            log.exception("realtime client failed")
            self.closed_reason = f"client error: {exc}"
        else:
            self.closed_reason = "the assistant closed the session"
        finally:
            for audio in self.audio.values():
                audio.done = True
            await self._touch()

    def _apply(self, event: dict[str, Any]) -> None:
        """Fold one server event into the page's view of the session."""
        kind = event["type"]
        if kind in ("session.created", "session.updated"):
            self.session = event["session"]
        elif kind == "input_audio_buffer.speech_started":
            self._speaking = True
            self._spoken_turn(event["item_id"])
        elif kind == "input_audio_buffer.committed":  # after speech_stopped, or for a commit
            self._speaking = False
            self._commits += 1
            self._spoken_turn(event["item_id"])
        elif kind == "conversation.item.input_audio_transcription.delta":
            self._spoken_turn(event["item_id"]).question += event["delta"]
        elif kind == "conversation.item.input_audio_transcription.completed":
            turn = self._spoken_turn(event["item_id"])
            turn.question, turn.heard = event["transcript"].strip(), True
            if not turn.question:  # noise, not speech: nothing to show
                self.turns.remove(turn)
        elif kind == "conversation.item.input_audio_transcription.failed":
            self.turns.remove(self._spoken_turn(event["item_id"]))
            self.errors.append(f"Speech recognition failed: {event['error']['message']}")
        elif kind == "response.created":
            self._response_created(event["response"])
        elif kind in ("response.output_text.delta", "response.output_audio_transcript.delta"):
            if (turn := self._turn_of(event["response_id"])) is not None:
                turn.answer += event["delta"]
        elif kind == "response.output_audio.delta":
            if (audio := self.audio.get(event["response_id"])) is not None:
                audio.chunks.append(base64.b64decode(event["delta"]))
        elif kind == "response.done":
            self._response_done(event["response"])
        elif kind == "response.timeline":
            if (turn := self._turn_of(event["response_id"])) is not None:
                turn.timeline = event["timeline"]
                if cited := event.get("citation"):
                    turn.citation = f"{cited['path']} — {cited['heading']}" if cited.get("heading") else cited["path"]
        elif kind == "error":
            self._error(event["error"])

    def _spoken_turn(self, item_id: str) -> Turn:
        turn = next((t for t in self.turns if t.item_id == item_id), None)
        if turn is None:
            turn = Turn(spoken=True, item_id=item_id)
            self.turns.append(turn)
        return turn

    def _turn_of(self, response_id: str) -> Turn | None:
        return next((t for t in self.turns if t.response_id == response_id), None)

    def _response_created(self, response: dict[str, Any]) -> None:
        """Attach the response to the newest question heard and not yet answered."""
        turn = next((t for t in reversed(self.turns) if t.response_id is None and t.heard), None)
        if turn is None:
            turn = Turn(spoken=False, heard=True)
            self.turns.append(turn)
        turn.response_id = response["id"]
        if "audio" in response["output_modalities"]:
            for done in [rid for rid, audio in self.audio.items() if audio.done]:
                del self.audio[done]  # played (a player streaming it holds its own reference) or never to be
            self.audio[response["id"]] = AnswerAudio(response["id"])
            self.audio_replies.append(response["id"])

    def _response_done(self, response: dict[str, Any]) -> None:
        turn = self._turn_of(response["id"])
        if turn is not None:
            turn.status = response["status"]
            details = response.get("status_details") or {}
            turn.detail = details.get("reason") or (details.get("error") or {}).get("message")
        if (audio := self.audio.get(response["id"])) is not None:
            audio.done, audio.cut = True, response["status"] == "cancelled"

    def _error(self, error: dict[str, Any]) -> None:
        event_id = error.get("event_id")
        if event_id is not None:
            self._refused.add(event_id)
            if error.get("code") in self._quiet.pop(event_id, ()):
                return
        self.errors.append(error.get("message") or error.get("code") or "unknown error")
