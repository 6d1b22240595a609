"""What a voice session and its client say to each other, as typed values.

The settings a client may change (:class:`SessionSettings`, :class:`TurnDetection`), the reply in
flight (:class:`Reply`), the events a session sends, in order, through its outbox (``User*`` for
the user's turn, ``Response*`` for the reply; :data:`PipelineEvent` is their union), and
:class:`TurnError` for a request the session's state does not allow. ``assistant/realtime.py``
renders each event as the Realtime API's server events.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from assistant.image_reading import ImageText
from assistant.timeline import Timeline
from speech.cancel import CancelToken


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD: silence that ends a turn, audio kept before speech, Silero threshold, and
    whether a finished turn gets an answer and whether speech interrupts a reply."""

    silence_duration_ms: int = 500
    prefix_padding_ms: int = 300
    threshold: float = 0.5
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class SessionSettings:
    """What a client may change during a session. ``turn_detection=None``: the VAD still cuts
    utterances, but the server neither answers nor interrupts on its own."""

    output_modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None
    language: str = "en"
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)


@dataclass(frozen=True)
class UserSpeechStarted:
    item_id: str
    audio_start_ms: int


@dataclass(frozen=True)
class UserSpeechStopped:
    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class UserAudioCommitted:
    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class UserTranscriptDelta:
    item_id: str
    delta: str


@dataclass(frozen=True)
class UserTranscriptDone:
    item_id: str
    transcript: str
    audio_s: float


@dataclass(frozen=True)
class UserTranscriptFailed:
    item_id: str
    error: str


@dataclass
class Reply:
    """One response in flight: its ids, cancellation token, timeline and what was sent."""

    id: str
    item_id: str
    request_id: str
    question: str
    token: CancelToken
    timeline: Timeline
    modalities: tuple[str, ...]
    max_output_tokens: int | None
    metadata: dict[str, str] | None = None
    status: str = "in_progress"  # completed | incomplete | cancelled | failed
    reason: str | None = None  # turn_detected | client_cancelled | max_output_tokens
    error: str | None = None
    text: str = ""  # generated so far
    sent_text: str = ""  # text deltas written to the client
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    citation: dict[str, str] | None = None  # the handbook section the answer is attributed to
    audio_sent_s: float = 0.0
    play_start: float | None = None
    recorded: bool = False  # the conversation holds this turn (the answerer adds finished ones)
    finish_queued: bool = False
    delivered: bool = False
    held: bool = False  # a speculative answer: generated, but nothing is sent until the turn is confirmed
    discarded: bool = False  # a speculation the user talked over: none of its events is ever sent
    task: asyncio.Task[None] | None = None
    images: list[asyncio.Future[ImageText]] = field(default_factory=list)  # being read; their text goes before the question
    pieces: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities


@dataclass(frozen=True)
class ResponseStarted:
    reply: Reply


@dataclass(frozen=True)
class ResponseTextDelta:
    """Answer text (the audio transcript, or the text of a text-only reply)."""

    reply: Reply
    delta: str


@dataclass(frozen=True)
class ResponseAudioDelta:
    """PCM16 mono answer audio at ``VoiceConfig.sample_rate``."""

    reply: Reply
    pcm: bytes
    duration_s: float


@dataclass(frozen=True)
class ResponseFinished:
    """The reply ended; read its status, text, usage and timeline when this is sent."""

    reply: Reply


PipelineEvent = (
    UserSpeechStarted | UserSpeechStopped | UserAudioCommitted | UserTranscriptDelta | UserTranscriptDone
    | UserTranscriptFailed | ResponseStarted | ResponseTextDelta | ResponseAudioDelta | ResponseFinished
)  # fmt: skip


class TurnError(Exception):
    """A client request that the session's state does not allow (an ``error`` event, not a crash)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


__all__ = [
    "PipelineEvent",
    "Reply",
    "ResponseAudioDelta",
    "ResponseFinished",
    "ResponseStarted",
    "ResponseTextDelta",
    "SessionSettings",
    "TurnDetection",
    "TurnError",
    "UserAudioCommitted",
    "UserSpeechStarted",
    "UserSpeechStopped",
    "UserTranscriptDelta",
    "UserTranscriptDone",
    "UserTranscriptFailed",
]
