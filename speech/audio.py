"""Audio utilities: PCM16/float conversion with validation, resampling, framing, WAV I/O.

Every entry point checks its input and raises ``AudioFormatError`` saying what was wrong and what
is accepted, so a server can answer bad client audio with an error and keep the session.
Resampling uses FFmpeg's libswresample through PyAV, which faster-whisper already depends on;
PyAV is imported only when a rate actually changes, so 16 kHz audio needs none.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np

SUPPORTED_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)  # 22050: espeak-ng, VITS
_BYTES_LIKE = (bytes, bytearray, memoryview)


class AudioFormatError(ValueError):
    """Audio that cannot be used as given; the message says what is accepted."""


def check_rate(sample_rate: int, accepted: tuple[int, ...] = SUPPORTED_RATES) -> int:
    """Return ``sample_rate`` if it is one of ``accepted``, else raise AudioFormatError."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise AudioFormatError(f"sample rate must be an integer in Hz, got {sample_rate!r}")
    if int(sample_rate) not in accepted:
        raise AudioFormatError(
            f"unsupported sample rate {sample_rate} Hz; accepted: "
            + ", ".join(str(r) for r in accepted)
        )
    return int(sample_rate)


def to_float32(samples: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """Mono audio as float32 in [-1, 1]: from PCM16 little-endian bytes, int16 or float arrays."""
    if isinstance(samples, _BYTES_LIKE):
        data = bytes(samples)
        if len(data) % 2:
            raise AudioFormatError(
                f"PCM16 audio must have an even number of bytes (2 per sample), got {len(data)}"
            )
        samples = np.frombuffer(data, dtype="<i2")
    if not isinstance(samples, np.ndarray):
        raise AudioFormatError(
            f"audio must be PCM16 bytes or a numpy array, got {type(samples).__name__}"
        )
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise AudioFormatError(f"audio must be mono (one dimension), got shape {samples.shape}")
    if samples.size == 0:
        raise AudioFormatError("audio is empty (0 samples)")
    if samples.dtype == np.int16:
        return samples.astype(np.float32) / 32768.0
    if samples.dtype in (np.float32, np.float64):
        if not np.isfinite(samples).all():
            bad = int(np.count_nonzero(~np.isfinite(samples)))
            raise AudioFormatError(
                f"audio has {bad} NaN or infinite samples; samples must be finite"
            )
        return samples.astype(np.float32, copy=False)
    raise AudioFormatError(
        f"audio dtype {samples.dtype} is not supported; use int16 PCM or float32/float64 in [-1, 1]"
    )


def to_pcm16(samples: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """Mono audio as int16 PCM (floats are clipped to [-1, 1] and scaled by 32767)."""
    floats = to_float32(samples)  # validates shape, emptiness and finiteness
    if isinstance(samples, np.ndarray) and samples.dtype == np.int16:
        return samples.reshape(-1)
    return np.round(np.clip(floats, -1.0, 1.0) * 32767.0).astype(np.int16)


class Resampler:
    """Streaming resampler for one audio stream (keeps the filter state between calls).

    The output is aligned with the input: sample ``n`` out corresponds to time ``n / dst_rate``
    of the input stream; ``flush()`` returns the tail the filter still holds.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        self.src_rate = check_rate(src_rate)
        self.dst_rate = check_rate(dst_rate)
        self._swr = None
        if self.src_rate != self.dst_rate:
            import av

            self._frame = av.AudioFrame
            self._swr = av.AudioResampler(format="flt", layout="mono", rate=self.dst_rate)

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Resample the next piece of the stream (float32 mono)."""
        floats = to_float32(samples)
        if self._swr is None:
            return floats
        frame = self._frame.from_ndarray(
            np.ascontiguousarray(floats).reshape(1, -1), format="flt", layout="mono"
        )
        frame.sample_rate = self.src_rate
        return self._collect(self._swr.resample(frame))

    def flush(self) -> np.ndarray:
        """The samples still inside the filter, at the end of the stream."""
        if self._swr is None:
            return np.zeros(0, np.float32)
        return self._collect(self._swr.resample(None))

    @staticmethod
    def _collect(frames: list) -> np.ndarray:  # of av.AudioFrame
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32)


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a whole clip (float32 mono); the length becomes ``round(n * dst / src)``."""
    resampler = Resampler(src_rate, dst_rate)
    out = np.concatenate([resampler.process(samples), resampler.flush()])
    expected = round(len(samples) * dst_rate / src_rate)
    return out[:expected] if len(out) >= expected else np.pad(out, (0, expected - len(out)))


def split_frames(samples: np.ndarray, frame_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut into whole frames: a ``(n_frames, frame_len)`` view and the leftover samples."""
    if frame_len <= 0:
        raise AudioFormatError(f"frame length must be positive, got {frame_len}")
    n = len(samples) // frame_len
    return samples[: n * frame_len].reshape(n, frame_len), samples[n * frame_len :]


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A PCM16 WAV file's bytes -> (float32 mono samples, sample rate); stereo is averaged."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise AudioFormatError(f"not a readable WAV file: {exc}") from exc
    if width != 2:
        raise AudioFormatError(f"WAV must be 16-bit PCM, got {8 * width}-bit samples")
    pcm = np.frombuffer(frames[: len(frames) - len(frames) % (2 * channels)], dtype="<i2")
    if pcm.size == 0:
        raise AudioFormatError("WAV file has no samples")
    floats = pcm.astype(np.float32).reshape(-1, channels).mean(axis=1) / 32768.0
    return floats.astype(np.float32), rate


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a PCM16 WAV file -> (float32 mono samples, sample rate)."""
    return decode_wav(Path(path).read_bytes())


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """Write mono audio (float or int16) as a 16-bit PCM WAV file; returns the path."""
    pcm = to_pcm16(samples)
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.astype("<i2").tobytes())
    return path
