"""Pick and load the TTS backend named in ``TTSConfig.backend`` (imports only that backend)."""

from __future__ import annotations

import importlib

from speech.config import TTSConfig
from speech.tts.base import TTSBackend

BACKENDS = {  # name -> (module, class); imported on demand: coqui pulls in torch
    "hibari": ("speech.tts.hibari", "HibariTTS"),
    "coqui": ("speech.tts.coqui", "CoquiTTS"),
    "espeak": ("speech.tts.espeak", "EspeakTTS"),
}


def load_tts(config: TTSConfig | None = None) -> TTSBackend:
    """The configured backend, loaded (in a worker process of its own with ``config.processes``);
    raises TTSUnavailable naming what to install if missing."""
    config = config or TTSConfig()
    if config.processes:
        from speech.tts.process import ProcessVoice

        return ProcessVoice(config, load_here)
    return load_here(config)


def load_here(config: TTSConfig) -> TTSBackend:
    """The configured backend, loaded in this process (``config.processes`` aside)."""
    module, name = BACKENDS[config.backend]  # TTSConfig only accepts these names
    return getattr(importlib.import_module(module), name)(config)
