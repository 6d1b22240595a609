"""Which ASR backend a configuration gets, loaded: the one place that knows every backend."""

from __future__ import annotations

from contextlib import AbstractContextManager

from speech.asr.backend import ASRBackend, FasterWhisperBackend, resolve_device
from speech.config import ASRConfig, ConfigError


def backend_name(config: ASRConfig) -> str:
    """The backend ``config`` asks for: "auto" is "torch" on a GPU or for random weights, else
    "faster-whisper" (CTranslate2 is the faster one on the CPU)."""
    if config.backend != "auto":
        return config.backend
    on_gpu = resolve_device(config.device) == "cuda"
    return "torch" if on_gpu or config.load_format == "dummy" else "faster-whisper"


def load_backend(config: ASRConfig, gpu_lock: AbstractContextManager | None = None) -> ASRBackend:
    """The ASR backend :func:`backend_name` picks, model loaded; ``gpu_lock`` (the torch backend
    holds it around its GPU work) is the lock the process's CUDA graph captures hold."""
    name = backend_name(config)
    if name == "faster-whisper":
        if config.load_format == "dummy":
            raise ConfigError("ASRConfig.load_format='dummy' needs the torch backend (random weights)")
        return FasterWhisperBackend(config)
    from speech.asr.torch_backend import TorchWhisperBackend  # imports torch: only when asked for

    return TorchWhisperBackend(config, gpu_lock=gpu_lock)
