"""Pick and load the TTS backend named in ``TTSConfig.backend`` (imports only that backend)."""

from __future__ import annotations

from speech.config import ConfigError, TTSConfig
from speech.tts.base import TTSBackend


def load_tts(config: TTSConfig | None = None) -> TTSBackend:
    """The configured backend, loaded; raises TTSUnavailable naming what to install if missing."""
    config = config or TTSConfig()
    if config.backend == "hibari":
        from speech.tts.hibari import HibariTTS

        return HibariTTS(config)
    if config.backend == "coqui":
        from speech.tts.coqui import CoquiTTS

        return CoquiTTS(config)
    if config.backend == "espeak":
        from speech.tts.espeak import EspeakTTS

        return EspeakTTS(config)
    raise ConfigError(f"unknown TTS backend {config.backend!r}")  # TTSConfig validation stops this
