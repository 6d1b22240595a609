"""Streaming text-to-speech: one interface (``TTSBackend.stream``), three backends."""

from speech.tts.base import TTSBackend, TTSUnavailable
from speech.tts.factory import load_tts

__all__ = ["TTSBackend", "TTSUnavailable", "load_tts"]
