"""The ASR backend: a speech recognizer over whole 16 kHz clips, one instance for every session.

``FasterWhisperBackend`` (CTranslate2, one clip at a time) serves the CPU;
:class:`~speech.asr.torch_backend.TorchWhisperBackend` (PyTorch, many clips per batch) the GPU.
:func:`speech.asr.factory.load_backend` picks one by ``ASRConfig.backend`` and ``ASRConfig.device``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from speech.audio import to_float32
from speech.config import ASRConfig, ConfigError

ASR_SAMPLE_RATE = 16000


def repeats_a_sentence(text: str) -> bool:
    """Whether ``text`` says one sentence twice in a row: a repetition loop too short for the
    compression ratio to show. Whisper base wrote "I am going out for a little while. I am going
    out for a little while. See you in a month." for two questions played backwards at once
    (average log-probability -0.76, compression ratio 1.39: both within their thresholds). A
    sentence counts from three words (or six characters without spaces, as in Chinese), so a
    spoken "Yes. Yes." stays."""
    sentences = [s.strip().lower() for s in re.split(r"(?<=[.!?。！？])\s*", text) if s.strip()]
    return any(a == b and (len(a.split()) >= 3 or len(a) >= 6 and " " not in a) for a, b in pairwise(sentences))


class ASRError(RuntimeError):
    """Transcription of an utterance failed; the message carries the backend's error."""


@dataclass(frozen=True)
class Decoded:
    """A backend's transcript of one clip, after the hallucination guards."""

    text: str
    language: str
    rejected_segments: int = 0
    tokens: int = 0  # text tokens decoded (prefix included)
    dummy: bool = False  # from random weights (load_format "dummy"): the text means nothing


class ASRBackend(ABC):
    """A speech recognizer over whole 16 kHz float32 clips; one instance serves every session."""

    sample_rate = ASR_SAMPLE_RATE
    supported_languages: tuple[str, ...]
    device: str = "cpu"  # where the model runs, resolved (cpu, cuda, cuda:1)
    max_batch: int = 1  # how many clips one transcribe_batch call takes

    def memory_bytes(self) -> dict[str, int]:
        """Memory this backend holds on ``device`` by owner ("asr weights"; "asr buffers": KV
        cache, CUDA graphs, features), for the server's memory ledger. {}: it cannot say
        (faster-whisper: CTranslate2 reports none)."""
        return {}

    def check_language(self, language: str) -> None:
        """Raise ConfigError unless ``language`` is "auto" or one this model knows."""
        if language != "auto" and language not in self.supported_languages:
            known = ", ".join(self.supported_languages[:12])
            raise ConfigError(
                f"language {language!r} is not supported by this ASR model; use 'auto' or one "
                f"of: {known}{', ...' if len(self.supported_languages) > 12 else ''}"
            )

    @abstractmethod
    def transcribe(
        self, audio: np.ndarray, prefix: str = "", language: str | None = None
    ) -> Decoded:
        """Transcribe ``audio`` (text starting with ``prefix`` if given) in ``language``
        ("auto" detects; None: the backend's configured language)."""

    def transcribe_batch(self, clips: list[tuple[np.ndarray, str, str | None]]) -> list[Decoded]:
        """Transcribe each ``(audio, prefix, language)``; backends that batch override this."""
        return [self.transcribe(audio, prefix, language) for audio, prefix, language in clips]


class FasterWhisperBackend(ASRBackend):
    """Whisper through faster-whisper (CTranslate2), with guards against made-up text.

    faster-whisper skips a window whose ``no_speech_prob`` is above ``no_speech_threshold`` while
    its ``avg_logprob`` is below ``log_prob_threshold`` (silence, noise). A segment it keeps is
    still dropped here if its ``avg_logprob`` is below ``log_prob_threshold`` (e.g. babble that is
    not words), its ``compression_ratio`` above ``compression_ratio_threshold`` (repetition
    loops) or it says one sentence twice in a row (:func:`repeats_a_sentence`, shorter loops).
    Decoding is greedy at temperature 0 with no fallback, so latency is predictable.
    """

    def __init__(self, config: ASRConfig) -> None:
        from faster_whisper import WhisperModel

        if config.model_path is None:
            raise ConfigError(
                "ASRConfig.model_path is not set: give a CTranslate2 Whisper directory "
                "(model.bin, config.json, tokenizer.json, vocabulary.*)"
            )
        path = Path(config.model_path)
        if not (path / "model.bin").is_file():
            raise ConfigError(f"{path} is not a CTranslate2 Whisper directory: no model.bin in it")
        self.config = config
        self.device = resolve_device(config.device)
        self._model = WhisperModel(
            str(path),
            device=resolve_device(config.device),
            compute_type=config.compute_type,
            cpu_threads=config.cpu_threads,
        )
        self.supported_languages = tuple(self._model.supported_languages)
        self.check_language(config.language)

    def transcribe(
        self, audio: np.ndarray, prefix: str = "", language: str | None = None
    ) -> Decoded:
        config = self.config
        language = config.language if language is None else language
        if len(self.supported_languages) == 1:
            language = self.supported_languages[0]  # an English-only model
        segments, info = self._model.transcribe(
            to_float32(audio),
            language=None if language == "auto" else language,
            beam_size=config.beam_size,
            temperature=0.0,
            vad_filter=False,  # our VAD already chose the audio
            without_timestamps=True,
            condition_on_previous_text=False,
            prefix=prefix or None,
            no_speech_threshold=config.no_speech_threshold,
            log_prob_threshold=config.log_prob_threshold,
            compression_ratio_threshold=config.compression_ratio_threshold,
        )
        kept, rejected, tokens = [], 0, 0
        for segment in segments:
            tokens += len(segment.tokens)
            if (
                segment.avg_logprob < config.log_prob_threshold
                or segment.compression_ratio > config.compression_ratio_threshold
                or config.reject_repeated_sentences and repeats_a_sentence(segment.text)
            ):
                rejected += 1
            else:
                kept.append(segment.text)
        return Decoded("".join(kept).strip(), info.language, rejected, tokens)


def resolve_device(device: str) -> str:
    """``ASRConfig.device`` made concrete: "auto" is "cuda" when PyTorch sees a GPU, else "cpu"."""
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


__all__ = ["ASR_SAMPLE_RATE", "ASRBackend", "ASRError", "Decoded", "FasterWhisperBackend", "resolve_device"]
