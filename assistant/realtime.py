"""The OpenAI Realtime API (GA event names) over one WebSocket: client events in, server events out.

:class:`RealtimeSession` parses each client event (:mod:`assistant.client_events`), turns it into a
call on the session's :class:`~assistant.pipeline.VoicePipeline`, and renders the pipeline's
events as server events. Every problem with a client event is answered with an ``error`` event
and the session lives on; only a run of ``max_errors`` invalid events in a row, or a sustained
flood over ``max_events_per_s``, closes the socket (1008). A client that stops reading is closed
(1008) once a send has waited ``send_timeout_s``, and its session is released either way. Each
finished response is followed by an extra ``response.timeline`` event with its per-stage timings.
docs/protocol.md lists every event with examples, the limits and the deviations from OpenAI's API.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from dataclasses import replace
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from assistant.client_events import (
    AudioAppend, AudioClear, AudioCommit, AudioInput, ClientError, ItemCreate, ResponseCancel, ResponseCreate,
    ResponseParams, SessionAudio, SessionPatch, SessionUpdate, ClientEvent, error_event, new_event_id, parse_event,
)  # fmt: skip
from assistant.config import SYSTEM_PROMPT, SYSTEM_PROMPT_ZH, ServerConfig
from assistant.events import (
    Reply, ResponseAudioDelta, ResponseFinished, ResponseStarted, ResponseTextDelta, SessionSettings, TurnDetection,
    TurnError, UserAudioCommitted, UserSpeechStarted, UserSpeechStopped, UserTranscriptDelta, UserTranscriptDone,
    UserTranscriptFailed,
)  # fmt: skip
from assistant.image_reading import ImageError, check_count
from assistant.pipeline import VoicePipeline
from assistant.timeline import TimelineMetrics
from assistant.token_bucket import TokenBucket
from assistant.voice_services import VoiceServices
from speech.audio import AudioFormatError
from speech.front_end import FrontEndError
from speech.config import ConfigError

log = logging.getLogger(__name__)

CLOSE_POLICY = 1008  # too many invalid events in a row, a sustained flood, or a client that does not read
CLOSE_TRY_AGAIN_LATER = 1013  # the server (or this client address) is at its session limit
CLOSE_WAIT_S = 2.0  # the most a close frame may wait to be written


# ---- one connection --------------------------------------------------------------------------------
class RealtimeSession:
    """One WebSocket client: its pipeline, its settings as the client sees them, its error budget."""

    def __init__(self, ws: WebSocket, services: VoiceServices, config: ServerConfig, model_name: str,
                 metrics: TimelineMetrics | None = None) -> None:  # fmt: skip
        self.ws = ws
        self.address = ws.client.host if ws.client else ""  # the client's IP address (sessions per address are limited)
        self.services = services
        self.config = config
        self.model_name = model_name
        self.pipeline = VoicePipeline(services, self._send, metrics, max_conversation_chars=config.max_conversation_chars)
        self._errors = 0
        self._limited = 0  # events refused for rate since the bucket was last full
        self._bucket = TokenBucket(config.max_events_per_s, 2 * config.max_events_per_s)
        self._gone = False
        self._stalled = asyncio.Event()  # a send timed out: the client is not reading

    async def run(self) -> None:
        """Serve the connection until the client leaves, is closed for abuse, or stops reading; the
        reply in flight is then aborted and the session released, whatever state the sender is in."""
        await self.pipeline.start()
        self.pipeline.outbox.put(self._event("session.created", session=self._session_view()))
        reader = asyncio.ensure_future(self._read())
        stalled = asyncio.ensure_future(self._stalled.wait())
        try:
            await asyncio.wait((reader, stalled), return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                log.warning("session %s: a send waited %.0f s; closing it", self.pipeline.id, self.config.send_timeout_s)
                await self._close(CLOSE_POLICY, "send timed out: the client is not reading")
        finally:
            for task in (reader, stalled):
                task.cancel()
            await asyncio.gather(reader, stalled, return_exceptions=True)
            self._gone = True
            await self.pipeline.close()

    async def _read(self) -> None:
        """Handle client events until the client leaves or is closed for abuse."""
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self._handle(message)
            if self._errors >= self.config.max_errors or self._limited >= self.config.max_errors:
                why = "invalid events in a row" if self._errors >= self.config.max_errors else "events over the rate limit"
                count = max(self._errors, self._limited)
                self.pipeline.outbox.put(error_event("too_many_errors", f"{count} {why}; closing the session"))
                try:  # the error goes out first, unless the client does not read it
                    async with asyncio.timeout(self.config.send_timeout_s):
                        await self.pipeline.outbox.sync()
                except TimeoutError:
                    pass
                await self._close(CLOSE_POLICY, f"too many {why}")
                return

    async def _close(self, code: int, reason: str) -> None:
        self._gone = True
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self.ws.close(code, reason)
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            pass

    async def _handle(self, message: dict[str, Any]) -> None:
        event_id = None
        if not self._bucket.take():
            self._limited += 1
            self.pipeline.outbox.put(error_event(
                "rate_limited", f"more than {self.config.max_events_per_s:g} events per second; this one was dropped"))  # fmt: skip
            return
        if self._bucket.full:
            self._limited = 0
        try:
            if message.get("text") is None:
                raise ClientError("binary_not_supported", "send events as JSON text frames, not binary frames")
            event = parse_event(message["text"], self.config.max_message_bytes)
            event_id = event.event_id
            await self._dispatch(event)
            self._errors = 0
        except ClientError as exc:
            self._refuse(exc.code, str(exc), exc.event_id or event_id, exc.param)
        except TurnError as exc:
            self._refuse(exc.code, str(exc), event_id)
        except ImageError as exc:
            self._refuse(exc.code, str(exc), event_id, "item.content")
        except FrontEndError as exc:  # the server's fault, not the client's: not counted as an invalid event
            log.error("session %s: %s", self.pipeline.id, exc)
            self.pipeline.outbox.put(error_event(
                "speech_front_end_restarted", "the speech front end stopped and was restarted; the audio of the utterance "
                "in progress was lost, please say it again", event_id, "audio", kind="server_error"))  # fmt: skip
        except AudioFormatError as exc:
            self._refuse("invalid_audio_format", f"{exc} (expected PCM16 mono at {self.services.config.sample_rate} Hz)",
                         event_id, "audio")  # fmt: skip

    def _refuse(self, code: str, message: str, event_id: str | None, param: str | None = None) -> None:
        self._errors += 1
        self.pipeline.outbox.put(error_event(code, message, event_id, param))

    async def _dispatch(self, event: ClientEvent) -> None:
        pipeline = self.pipeline
        if isinstance(event, AudioAppend):
            await pipeline.feed(_decode_audio(event.audio))
        elif isinstance(event, SessionUpdate):
            await pipeline.configure(self._apply(event.session))
            pipeline.outbox.put(self._event("session.updated", session=self._session_view()))
        elif isinstance(event, AudioCommit):
            pipeline.commit()
        elif isinstance(event, AudioClear):
            pipeline.clear()
            pipeline.outbox.put(self._event("input_audio_buffer.cleared"))
        elif isinstance(event, ItemCreate):
            if event.previous_item_id is not None and event.previous_item_id != pipeline.last_item_id:
                raise ClientError("invalid_value", "items can only be added at the end of the conversation "
                                  f"(previous_item_id {pipeline.last_item_id!r})", "previous_item_id")  # fmt: skip
            previous = pipeline.last_item_id
            item = event.item
            text = item.text
            if len(text) > self.config.max_item_chars:
                raise ClientError("item_too_large", f"the item's text is {len(text)} characters; the limit is "
                                  f"{self.config.max_item_chars}", "item.content")  # fmt: skip
            images = await self._images(item.image_urls)
            item_id = pipeline.add_item(item.role, text, item.id, images)
            # An image part is echoed without its data (the client has it; a megabyte back is waste).
            view = _message_item(item_id, item.role, [
                {**p.model_dump(), "image_url": None} if p.type == "input_image" else p.model_dump() for p in item.content])
            pipeline.outbox.put(self._event("conversation.item.added", previous_item_id=previous, item=view))
            pipeline.outbox.put(self._event("conversation.item.done", previous_item_id=previous, item=view))
        elif isinstance(event, ResponseCreate):
            params = event.response or ResponseParams()
            pipeline.create_response(
                tuple(params.output_modalities) if params.output_modalities else None,
                None if params.max_output_tokens in (None, "inf") else int(params.max_output_tokens),  # type: ignore[arg-type]
                params.metadata,
            )  # fmt: skip
        elif isinstance(event, ResponseCancel):
            pipeline.cancel_response(event.response_id)

    async def _images(self, urls: list[str]) -> list[bytes]:
        """The encoded images of an item's data URLs, each checked (decoded in a worker thread);
        raises ImageError for the first that cannot be taken."""
        check_count(len(urls))
        images = []
        for url in urls:
            data = self.services.images.image_bytes(url)
            await asyncio.to_thread(self.services.images.check, data)
            images.append(data)
        return images

    # ---- session settings ----------------------------------------------------------------------
    def _apply(self, patch: SessionPatch) -> SessionSettings:
        """The pipeline settings after ``patch``; raises ClientError for values we cannot honour."""
        settings = self.pipeline.settings
        rate = self.services.config.sample_rate
        if patch.instructions is not None:
            raise ClientError("unsupported_value", "instructions are fixed: the handbook's system prompt", "session.instructions")
        if patch.output_modalities is not None:
            settings = replace(settings, output_modalities=tuple(patch.output_modalities))
        if patch.max_output_tokens is not None:
            limit = None if patch.max_output_tokens == "inf" else int(patch.max_output_tokens)
            settings = replace(settings, max_output_tokens=limit)
        audio = patch.audio or SessionAudio()
        for side, part in (("input", audio.input), ("output", audio.output)):
            fmt = part.format if part is not None else None
            if fmt is not None and fmt.rate not in (None, rate):
                raise ClientError("unsupported_value", f"audio is PCM16 at {rate} Hz only, not {fmt.rate} Hz",
                                  f"session.audio.{side}.format.rate")  # fmt: skip
        if audio.output is not None:
            if audio.output.voice not in (None, self._voice):
                raise ClientError("unsupported_value", f"the only voice is '{self._voice}'", "session.audio.output.voice")
            if audio.output.speed not in (None, 1.0):
                raise ClientError("unsupported_value", "speed 1.0 only", "session.audio.output.speed")
        if audio.input is not None:
            settings = self._apply_input(settings, audio.input)
        return settings

    def _apply_input(self, settings: SessionSettings, patch: AudioInput) -> SessionSettings:
        language = patch.transcription.language if patch.transcription else None
        if language is not None:
            try:
                self.services.asr.backend.check_language(language)
            except ConfigError as exc:
                raise ClientError("invalid_value", str(exc), "session.audio.input.transcription.language") from exc
            settings = replace(settings, language=language)
        if "turn_detection" in patch.model_fields_set:
            vad = patch.turn_detection
            if vad is None:
                return replace(settings, turn_detection=None)
            base = settings.turn_detection or TurnDetection(silence_duration_ms=self.services.config.hangover_ms)
            changes = {k: v for k, v in vad.model_dump(exclude={"type", "idle_timeout_ms"}).items() if v is not None}
            settings = replace(settings, turn_detection=replace(base, **changes))
        return settings

    def _tokens_used(self, requested: int | None) -> int:
        """The answer length limit actually applied: the client's, capped at the server's ``--max-tokens``."""
        cap = self.config.assistant.max_tokens
        return cap if requested is None else min(requested, cap)

    @property
    def _voice(self) -> str:
        return self.services.config.tts_voice or "heart"

    def _session_view(self) -> dict[str, Any]:
        s = self.pipeline.settings
        td = s.turn_detection
        fmt = {"type": "audio/pcm", "rate": self.services.config.sample_rate}
        detection = None if td is None else {
            "type": "server_vad", "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
            "silence_duration_ms": td.silence_duration_ms, "create_response": td.create_response,
            "interrupt_response": td.interrupt_response, "idle_timeout_ms": None,
        }  # fmt: skip
        return {
            "type": "realtime", "object": "realtime.session", "id": self.pipeline.id, "model": self.model_name,
            "output_modalities": list(s.output_modalities), "instructions": SYSTEM_PROMPT_ZH if s.language == "zh" else SYSTEM_PROMPT,
            "max_output_tokens": self._tokens_used(s.max_output_tokens), "tools": [], "tool_choice": "auto",
            "audio": {
                "input": {"format": fmt, "transcription": {"model": "whisper", "language": s.language},
                          "turn_detection": detection, "noise_reduction": None},
                "output": {"format": fmt, "voice": self._voice, "speed": 1.0},
            },
        }  # fmt: skip

    # ---- server events ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": new_event_id(), **fields}

    async def _send(self, event: object) -> None:
        """Write one pipeline event (or a ready server event) as JSON text frames; a send that
        waits ``send_timeout_s`` marks the client as not reading (run() then closes the session)."""
        if self._gone:
            return
        try:
            for payload in [event] if isinstance(event, dict) else self._render(event):
                async with asyncio.timeout(self.config.send_timeout_s):
                    await self.ws.send_text(_dumps(payload))
        except TimeoutError:
            self._gone = True
            self._stalled.set()
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client went away; run() ends the session
            self._gone = True

    def _render(self, event: object) -> list[dict[str, Any]]:
        ev = self._event
        if isinstance(event, UserSpeechStarted):
            return [ev("input_audio_buffer.speech_started", audio_start_ms=event.audio_start_ms, item_id=event.item_id)]
        if isinstance(event, UserSpeechStopped):
            return [ev("input_audio_buffer.speech_stopped", audio_end_ms=event.audio_end_ms, item_id=event.item_id)]
        if isinstance(event, UserAudioCommitted):
            item = _message_item(event.item_id, "user", [{"type": "input_audio", "transcript": None}])
            return [ev("input_audio_buffer.committed", item_id=event.item_id, previous_item_id=event.previous_item_id),
                    ev("conversation.item.added", previous_item_id=event.previous_item_id, item=item)]  # fmt: skip
        if isinstance(event, UserTranscriptDelta):
            return [ev("conversation.item.input_audio_transcription.delta", item_id=event.item_id, content_index=0, delta=event.delta)]
        if isinstance(event, UserTranscriptDone):
            item = _message_item(event.item_id, "user", [{"type": "input_audio", "transcript": event.transcript}])
            return [ev("conversation.item.input_audio_transcription.completed", item_id=event.item_id, content_index=0,
                       transcript=event.transcript, usage={"type": "duration", "seconds": round(event.audio_s, 3)}),
                    ev("conversation.item.done", item=item)]  # fmt: skip
        if isinstance(event, UserTranscriptFailed):
            return [ev("conversation.item.input_audio_transcription.failed", item_id=event.item_id, content_index=0,
                       error={"type": "transcription_error", "code": "asr_failed", "message": event.error})]  # fmt: skip
        if isinstance(event, ResponseStarted):
            reply = event.reply
            return [ev("response.created", response=self._response_view(reply)),
                    ev("response.output_item.added", response_id=reply.id, output_index=0,
                       item=_message_item(reply.item_id, "assistant", [], "in_progress"))]  # fmt: skip
        if isinstance(event, ResponseTextDelta):
            kind = "response.output_audio_transcript.delta" if event.reply.audio else "response.output_text.delta"
            return [ev(kind, **_part(event.reply), delta=event.delta)]
        if isinstance(event, ResponseAudioDelta):
            return [ev("response.output_audio.delta", **_part(event.reply), delta=base64.b64encode(event.pcm).decode())]
        if isinstance(event, ResponseFinished):
            return self._render_finished(event.reply)
        raise TypeError(f"no server event for {type(event).__name__}")

    def _render_finished(self, reply: Reply) -> list[dict[str, Any]]:
        ev = self._event
        if reply.audio:
            done = [ev("response.output_audio.done", **_part(reply)),
                    ev("response.output_audio_transcript.done", **_part(reply), transcript=reply.sent_text)]  # fmt: skip
        else:
            done = [ev("response.output_text.done", **_part(reply), text=reply.sent_text)]
        item = self._output_item(reply)
        return [*done, ev("response.output_item.done", response_id=reply.id, output_index=0, item=item),
                ev("response.done", response=self._response_view(reply, [item])),
                ev("response.timeline", response_id=reply.id, item_id=reply.item_id, timeline=reply.timeline.to_dict(),
                   citation=reply.citation)]  # fmt: skip

    def _output_item(self, reply: Reply) -> dict[str, Any]:
        part = ({"type": "output_audio", "transcript": reply.sent_text} if reply.audio
                else {"type": "output_text", "text": reply.sent_text})  # fmt: skip
        return _message_item(reply.item_id, "assistant", [part], "completed" if reply.status == "completed" else "incomplete")

    def _response_view(self, reply: Reply, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        details: dict[str, Any] | None = None
        if reply.status in ("cancelled", "incomplete"):
            details = {"type": reply.status, "reason": reply.reason}
        elif reply.status == "failed":
            details = {"type": "failed", "error": {"type": "server_error", "code": "answer_failed", "message": reply.error}}
        p, c, o = reply.prompt_tokens, reply.cached_tokens, reply.output_tokens
        usage = None if reply.status == "in_progress" else {
            "total_tokens": p + o, "input_tokens": p, "output_tokens": o,
            "input_token_details": {"text_tokens": p, "audio_tokens": 0, "cached_tokens": c,
                                    "cached_tokens_details": {"text_tokens": c, "audio_tokens": 0}},
            "output_token_details": {"text_tokens": o, "audio_tokens": 0},
        }  # fmt: skip
        return {
            "object": "realtime.response", "id": reply.id, "status": reply.status, "status_details": details,
            "output": output or [], "output_modalities": list(reply.modalities), "conversation_id": self.pipeline.id,
            "max_output_tokens": self._tokens_used(reply.max_output_tokens),
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": self.services.config.sample_rate}, "voice": self._voice}},
            "metadata": reply.metadata, "usage": usage,
        }  # fmt: skip


def _part(reply: Reply) -> dict[str, Any]:
    return {"response_id": reply.id, "item_id": reply.item_id, "output_index": 0, "content_index": 0}


def _message_item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": status, "content": content}


def _dumps(payload: dict[str, Any]) -> str:
    """The event as JSON text. Text that cannot be written as UTF-8 (a lone surrogate: client
    strings are checked on the way in, so this is a server bug) is never sent: the client gets a
    ``server_error`` naming the event type instead, and the session goes on."""
    text = json.dumps(payload, ensure_ascii=False)
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        log.error("a %s event holds text that is not valid Unicode; not sent", payload.get("type"))
        return json.dumps(error_event("unencodable_event", f"a {payload.get('type')!s:.64} event could not be encoded "
                                      "as UTF-8 and was dropped", kind="server_error"), ensure_ascii=True)  # fmt: skip
    return text


def _decode_audio(data: str) -> bytes:
    """PCM16 bytes from base64; a WAV file or an odd byte count is refused with a clear message."""
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ClientError("invalid_base64", f"'audio' is not valid base64: {exc}", "audio") from exc
    if pcm[:4] == b"RIFF":
        raise AudioFormatError("this is a WAV file; send the raw PCM16 samples without the header")
    return pcm


async def reject(ws: WebSocket, code: str, reason: str) -> None:
    """Refuse a connection over capacity: accept, send an ``error`` event, close with 1013."""
    await ws.accept()
    await ws.send_text(json.dumps(error_event(code, reason, kind="server_error")))
    await ws.close(CLOSE_TRY_AGAIN_LATER, "server at its session limit" if code == "session_limit_reached"
                   else "this client address is at its session limit")  # fmt: skip


__all__ = ["RealtimeSession", "reject"]
