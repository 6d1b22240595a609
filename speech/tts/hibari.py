"""The bundled neural voice: hibari-tts (an 8 MB ONNX student of Kokoro's af_heart, 24 kHz)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from speech.config import ConfigError, TTSConfig
from speech.tts.base import TTSBackend, TTSUnavailable

INSTALL = "pip install --no-deps hibari-tts==0.2.1"


class HibariTTS(TTSBackend):
    """English only; streams one chunk per sentence (hibari's own sentence splitting)."""

    name = "hibari"

    def __init__(self, config: TTSConfig) -> None:
        super().__init__(config)
        if not config.language.lower().startswith("en"):
            raise ConfigError(
                f"the hibari voice speaks English only, not {config.language!r}; "
                "use TTSConfig(backend='espeak') for other languages"
            )
        try:
            from hibari import Hibari
        except ImportError as exc:
            raise TTSUnavailable(f"the hibari backend needs hibari-tts: {INSTALL}") from exc
        self._tts = Hibari(
            voice=config.voice or "heart",
            model=_model_file(config.model_path),
            threads=config.threads,
        )
        self.sample_rate = int(Hibari.sample_rate)

    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        yield from self._tts.stream(text, speed=self.config.speed, seed=self.config.seed)


def _model_file(model_path: Path | None) -> str | None:
    """The ONNX file for ``model_path`` (a file, or hibari's package directory); None: default."""
    if model_path is None:
        return None
    path = Path(model_path)
    for candidate in (path, path / "assets" / "hibari.onnx", path / "hibari.onnx"):
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(
        f"TTSConfig.model_path={path}: no hibari ONNX voice there "
        "(give the .onnx file or the hibari package directory)"
    )
