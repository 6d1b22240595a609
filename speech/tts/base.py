"""The TTS interface: ``stream(text)`` yields audio chunks as soon as each is synthesized.

A backend only says how to turn text into a sequence of float32 pieces (``_synthesize``); the
base class wraps them as ``AudioChunk``s and honours cancellation between pieces, so a cancelled
reply stops within the piece being synthesized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np

from speech.cancel import CancelToken
from speech.config import TTSConfig
from speech.messages import AudioChunk


class TTSUnavailable(RuntimeError):
    """A TTS backend cannot run here; the message says what to install."""


class TTSBackend(ABC):
    """Text -> stream of mono float32 ``AudioChunk``s at ``sample_rate``."""

    name: str
    sample_rate: int
    device: str = "cpu"  # where it synthesizes (the coqui backend may run on CUDA)

    def __init__(self, config: TTSConfig) -> None:
        self.config = config

    def stream(self, text: str, cancel: CancelToken | None = None) -> Iterator[AudioChunk]:
        """Yield the audio of ``text`` chunk by chunk; stop as soon as ``cancel`` is cancelled."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        pieces = self._synthesize(text)
        try:
            while cancel is None or not cancel.cancelled:
                pcm = next(pieces, None)
                if pcm is None or (cancel is not None and cancel.cancelled):
                    return
                if len(pcm):
                    yield AudioChunk(np.asarray(pcm, np.float32).reshape(-1), self.sample_rate)
        finally:
            pieces.close()

    def synthesize(self, text: str) -> AudioChunk:
        """All of ``text`` as one chunk (for tests and benchmarks; streaming is ``stream``)."""
        chunks = [chunk.pcm for chunk in self.stream(text)]
        pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return AudioChunk(pcm, self.sample_rate)

    def close(self) -> None:
        """Release what the voice holds beyond memory (a worker process: speech/tts/process.py)."""

    @abstractmethod
    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        """The audio of ``text`` as float32 pieces in order, each synthesized when asked for."""
