"""Client events of the Realtime API: their models, and the parsing that refuses bad ones.

:func:`parse_event` turns one text frame into a validated event, or raises :class:`ClientError`
with the ``error`` code the client gets: too large, not JSON (nesting deeper than
``MAX_JSON_DEPTH`` included), strings that are not valid Unicode (a lone surrogate such as
``"\\ud800"`` cannot be written back as UTF-8, so it is refused here, before anything could echo
it), an unknown or unsupported type, or fields that do not validate (unknown fields and values
out of range are errors, as with OpenAI).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_JSON_DEPTH = 32  # real events nest 6 deep; deeper JSON is refused as invalid_json
ECHO_CHARS = 64  # at most this much of a client's unknown 'type' is quoted back in the error

UNSUPPORTED_EVENTS = (
    "conversation.item.retrieve", "conversation.item.truncate", "conversation.item.delete",
    "output_audio_buffer.clear", "transcription_session.update",
)  # fmt: skip


class ClientError(Exception):
    """A client event we refuse: becomes an ``error`` event (invalid_request_error)."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.event_id = event_id


def error_event(code: str, message: str, event_id: str | None = None, param: str | None = None,
                kind: str = "invalid_request_error") -> dict[str, Any]:  # fmt: skip
    """An OpenAI-shaped ``error`` server event."""
    return {"type": "error", "event_id": new_event_id(),
            "error": {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}}  # fmt: skip


def new_event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


# ---- client events --------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AudioFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int | None = None


class Transcription(_Strict):
    model: str | None = None
    language: str | None = None


class ServerVad(_Strict):
    type: Literal["server_vad"]
    threshold: float | None = Field(None, gt=0.15, lt=1.0)
    prefix_padding_ms: int | None = Field(None, ge=0, le=2000)
    silence_duration_ms: int | None = Field(None, ge=30, le=5000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: None = None


class AudioInput(_Strict):
    format: AudioFormat | None = None
    transcription: Transcription | None = None
    turn_detection: ServerVad | None = None
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: float | None = None


class SessionAudio(_Strict):
    input: AudioInput | None = None
    output: AudioOutput | None = None


MaxTokens = Annotated[int, Field(ge=1, le=4096)] | Literal["inf"]
Modalities = Annotated[list[Literal["audio", "text"]], Field(min_length=1, max_length=1)]


class SessionPatch(_Strict):
    type: Literal["realtime"] | None = None
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    audio: SessionAudio | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None


class ContentPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(_Strict):
    """An image in a user item, as OpenAI's Realtime API takes it: a data URL (never fetched)."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


class ItemIn(_Strict):
    id: str | None = None
    type: Literal["message"]
    role: Literal["user", "assistant"]
    status: Literal["completed"] | None = None
    content: Annotated[list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]], Field(min_length=1)]

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content if isinstance(part, ContentPart))

    @property
    def image_urls(self) -> list[str]:
        return [part.image_url for part in self.content if isinstance(part, ImagePart)]


class ResponseParams(_Strict):
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    conversation: Literal["auto"] | None = None


class ClientEvent(_Strict):
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: SessionPatch


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: ItemIn


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {
    m.model_fields["type"].annotation.__args__[0]: m  # type: ignore[union-attr]
    for m in (SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ResponseCreate, ResponseCancel)
}


def parse_event(text: str, max_bytes: int) -> ClientEvent:
    """One client event from a text frame; raises :class:`ClientError` saying what is wrong."""
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise ClientError("message_too_large", f"the event is {size} bytes; the limit is {max_bytes} bytes "
                          "(send audio in smaller input_audio_buffer.append events)")  # fmt: skip
    try:
        data = json.loads(text)
    except RecursionError as exc:
        raise ClientError("invalid_json", f"the message nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise ClientError("invalid_json", f"the message is not valid JSON: {exc}") from exc
    check_json(data)
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ClientError("invalid_event", "an event must be a JSON object with a string 'type'", "type")
    kind = data["type"]
    event_id = data["event_id"] if isinstance(data.get("event_id"), str) else None
    model = CLIENT_EVENTS.get(kind)
    if model is None:
        if kind in UNSUPPORTED_EVENTS:
            raise ClientError("unsupported_event_type", f"'{kind}' is not supported by this server", "type", event_id)
        shown = kind if len(kind) <= ECHO_CHARS else kind[:ECHO_CHARS] + "..."
        raise ClientError("unknown_event_type", f"unknown event type {shown!r}; supported: {', '.join(CLIENT_EVENTS)}",
                          "type", event_id)  # fmt: skip
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        code = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter"}.get(err["type"], "invalid_value")
        raise ClientError(code, f"invalid '{param}' in '{kind}': {err['msg']}", param, event_id) from exc


def check_json(data: object) -> None:
    """Refuse parsed JSON nested deeper than ``MAX_JSON_DEPTH`` (``invalid_json``) or holding a string
    (key or value) that is not valid Unicode (``invalid_text``: a lone surrogate from a ``\\udXXX``
    escape). Iterative, so no input can exhaust the stack."""
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _is_unicode(value):
                raise ClientError("invalid_text", "the event holds a string that is not valid Unicode "
                                  "(a lone surrogate such as \\ud800); send UTF-8 text")  # fmt: skip
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ClientError("invalid_json", f"the message nests deeper than {MAX_JSON_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["CLIENT_EVENTS", "MAX_JSON_DEPTH", "ClientError", "ClientEvent", "check_json", "error_event", "new_event_id", "parse_event"]
