"""Typed messages passed between the speech stages (VAD -> ASR -> caller, TTS -> caller).

Times called ``*_s`` are seconds of the audio stream (sample-accurate, starting at the first
sample a session received), so a caller can put them on its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpeechStarted:
    """An utterance began: ``start_s`` is its first voiced frame; ``detected_s``, when VAD knew."""

    utterance: int
    start_s: float
    detected_s: float


@dataclass(frozen=True)
class SpeechEnded:
    """An utterance ended.

    speech_end_s: end of the last voiced frame (when the user actually stopped).
    endpoint_s: when the decision was taken (hangover elapsed, or the caller committed).
    cut: the utterance reached ``VADConfig.max_utterance_s`` while still voiced and was ended there.
    """

    utterance: int
    start_s: float
    speech_end_s: float
    endpoint_s: float
    committed: bool = False
    cut: bool = False


@dataclass(frozen=True)
class SpeechPaused:
    """The utterance in progress has been silent ``VADConfig.pause_ms`` (less than the hangover):
    it may be over. ``speech_end_s`` is its last voiced frame, ``paused_s`` when VAD knew."""

    utterance: int
    speech_end_s: float
    paused_s: float


@dataclass(frozen=True)
class SpeechResumed:
    """Speech went on after a :class:`SpeechPaused`, before the hangover: the same utterance."""

    utterance: int
    resumed_s: float


@dataclass(frozen=True)
class Transcript:
    """A transcript of one utterance.

    A partial (``is_final=False``) carries only the stable prefix, so every partial is a prefix of
    the later partials and of the final. ``audio_end_s`` is the stream time the decoded audio ends
    at; ``queue_s`` and ``decode_s`` are the time spent waiting for and inside the model;
    ``decoded_at`` the ``time.perf_counter()`` instant its decode ended (so a consumer on another
    thread can tell how long it took to be handled after that: the worker's bookkeeping, the other
    results of its batch, the hand-off).
    ``speculative`` (with ``is_final``): a decode of the utterance so far made at a
    :class:`SpeechPaused`; the utterance may still go on (a :class:`SpeechResumed` then follows).
    """

    utterance: int
    text: str
    is_final: bool
    language: str
    audio_end_s: float
    queue_s: float
    decode_s: float
    speculative: bool = False
    decoded_at: float = 0.0


@dataclass(frozen=True)
class TranscriptionFailed:
    """The model raised while decoding an utterance's final; the session itself carries on."""

    utterance: int
    error: str


@dataclass(frozen=True)
class AudioChunk:
    """A piece of mono audio: float32 in [-1, 1] or int16 PCM, with its sample rate."""

    pcm: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / self.sample_rate


ASREvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechEnded | Transcript | TranscriptionFailed
