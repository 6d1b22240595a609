"""Audio between the browser and the assistant: microphone chunks in, answer audio out.

The browser's microphone arrives at its own rate (48 kHz int16 from Chromium) and the assistant
takes PCM16 mono at its session rate (24 kHz): :class:`StreamResampler` converts chunk by chunk
with no seams between chunks. Answer audio goes to the page's streaming player as small WAV files
(:func:`wav_bytes`). :func:`read_audio_file` decodes an uploaded recording (any format ffmpeg
reads), or says plainly that it is not audio.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np

FILTER_TAPS = 63


class NotAudioError(ValueError):
    """An uploaded file that holds no audio we can decode; the message says which file."""


def to_mono_float(samples: np.ndarray) -> np.ndarray:
    """Float32 mono in [-1, 1] from int16/int32/float samples, (n,) or (n, channels)."""
    data = np.asarray(samples)
    scale = float(np.iinfo(data.dtype).max) + 1.0 if data.dtype.kind == "i" else 1.0
    mono = data.astype(np.float32) / scale
    if mono.ndim == 2:
        mono = mono.mean(axis=1)
    return np.clip(mono, -1.0, 1.0).astype(np.float32)


def to_pcm16_bytes(samples: np.ndarray) -> bytes:
    """Little-endian PCM16 bytes from float samples in [-1, 1]."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class StreamResampler:
    """Resample a stream chunk by chunk: a windowed-sinc low-pass (when lowering the rate), then
    linear interpolation. Filter history and the interpolation phase carry across chunks."""

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {src_rate} and {dst_rate}")
        self.src_rate, self.dst_rate = src_rate, dst_rate
        self._step = src_rate / dst_rate
        cutoff = 0.9 * min(1.0, dst_rate / src_rate)  # of the source Nyquist frequency
        n = np.arange(FILTER_TAPS) - (FILTER_TAPS - 1) / 2
        taps = cutoff * np.sinc(cutoff * n) * np.hamming(FILTER_TAPS)
        self._taps = taps / taps.sum()
        self._history = np.zeros(FILTER_TAPS - 1)
        self._pending = np.zeros(0)  # filtered samples the next output may still need
        self._pos = 0.0  # where the next output sample lies in ``_pending``

    def process(self, samples: np.ndarray) -> np.ndarray:
        """The resampled continuation of the stream for the next float mono ``samples``."""
        if self.src_rate == self.dst_rate:
            return samples.astype(np.float32)
        padded = np.concatenate([self._history, samples])
        filtered = np.convolve(padded, self._taps, mode="valid")
        self._history = padded[len(padded) - (FILTER_TAPS - 1) :]
        buf = np.concatenate([self._pending, filtered])
        where = np.arange(self._pos, len(buf) - 1, self._step)
        i = where.astype(np.int64)
        frac = where - i
        out = buf[i] * (1.0 - frac) + buf[np.minimum(i + 1, len(buf) - 1)] * frac
        following = where[-1] + self._step if len(where) else self._pos
        keep = int(following)
        self._pending, self._pos = buf[keep:], following - keep
        return out.astype(np.float32)


def wav_bytes(pcm16: bytes, sample_rate: int) -> bytes:
    """A mono 16-bit WAV file holding ``pcm16``."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16)
    return out.getvalue()


def read_audio_file(path: Path, sample_rate: int) -> bytes:
    """PCM16 mono at ``sample_rate`` from an audio file (WAV, MP3, OGG, WebM, ... via ffmpeg)."""
    from gradio.processing_utils import audio_from_file

    try:
        rate, samples = audio_from_file(str(path))
    except Exception as exc:  # pydub/ffmpeg raise several unrelated types for a file that is not audio
        raise NotAudioError(f"{path.name} is not an audio file that can be read ({type(exc).__name__})") from exc
    if samples.size == 0:
        raise NotAudioError(f"{path.name} holds no audio")
    return to_pcm16_bytes(StreamResampler(rate, sample_rate).process(to_mono_float(samples)))
