"""Whisper's log-mel input features in PyTorch, computed as faster-whisper computes them.

Per clip: the audio gets 160 zero samples appended, a centred (reflect-padded) STFT with a
400-point periodic Hann window and hop 160, power spectrum without the last frame, the Slaney mel
filterbank, ``log10`` clamped at 1e-10, floored at the clip's maximum minus 8, and ``(x + 4) / 4``.
A clip's frames are then cut into 3000-frame (30 s) windows; a short window is padded with zeros
in feature space (not with the features of silence), so the features match faster-whisper's and
so do the transcripts. The reflect padding is done per clip on the host, so one batched STFT
serves clips of any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_FRAMES = 3000  # 30 s: the encoder's fixed input
TAIL_PADDING = 160  # zero samples appended before the STFT


def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """The Slaney-style mel filterbank (``n_mels`` x ``n_fft // 2 + 1``, float32), area-normalized.

    Slaney's mel scale is linear below 1 kHz (200/3 Hz a mel) and logarithmic above (a factor of
    6.4 every 27 mels); the triangles span 0 Hz to the Nyquist frequency.
    """
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel = min_log_hz / f_sp
    log_step = np.log(6.4) / 27.0

    def hz_to_mel(hz: float) -> float:
        return hz / f_sp if hz < min_log_hz else min_log_mel + np.log(hz / min_log_hz) / log_step

    mels = np.linspace(0.0, hz_to_mel(sample_rate / 2), n_mels + 2)
    hz = np.where(mels < min_log_mel, mels * f_sp,
                  min_log_hz * np.exp(log_step * (mels - min_log_mel)))  # fmt: skip
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    left, centre, right = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    rising = (bins[None, :] - left) / (centre - left)
    falling = (right - bins[None, :]) / (right - centre)
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (hz[2:] - hz[:-2]))[:, None]
    return weights.astype(np.float32)


@dataclass(frozen=True)
class Windows:
    """The 30 s feature windows of a batch of clips, and which clip each came from."""

    features: torch.Tensor  # (windows, n_mels, 3000)
    clip: list[int]  # clip index of each window
    first: list[bool]  # the window is its clip's first


class LogMel:
    """Computes the features of many clips at once on one device (one STFT for the batch)."""

    def __init__(self, n_mels: int, device: torch.device) -> None:
        self.device = device
        self.filters = torch.from_numpy(mel_filters(n_mels)).to(device)
        self.window = torch.hann_window(N_FFT, periodic=True, device=device)

    def features(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        """Each clip's normalized log-mel (n_mels x frames), frames = samples // 160."""
        half = N_FFT // 2
        padded = []
        for audio in clips:
            audio = np.pad(np.asarray(audio, np.float32), (0, TAIL_PADDING))
            if len(audio) <= half:  # too short to reflect: pad with zeros first
                audio = np.pad(audio, (0, half + 1 - len(audio)))
            padded.append(np.pad(audio, (half, half), mode="reflect"))
        longest = max(len(p) for p in padded)
        batch = np.zeros((len(padded), longest), np.float32)
        for row, samples in zip(batch, padded):
            row[: len(samples)] = samples
        signal = torch.from_numpy(batch).to(self.device, non_blocking=True)
        spectrum = torch.stft(signal, N_FFT, HOP, window=self.window, center=False, return_complex=True)
        power = spectrum.abs() ** 2  # (clips, freqs, frames)
        log_spec = torch.log10(torch.clamp(self.filters @ power, min=1e-10))
        out = []
        for i, audio in enumerate(clips):
            frames = (len(audio) + TAIL_PADDING) // HOP  # faster-whisper drops the last STFT frame
            spec = log_spec[i, :, :frames]
            spec = torch.maximum(spec, spec.max() - 8.0)
            out.append((spec + 4.0) / 4.0)
        return out

    def windows(self, clips: list[np.ndarray]) -> Windows:
        """Every clip cut into 30 s windows of 3000 frames (the last one zero-padded); a clip
        shorter than two frames has none."""
        features, clip_of, first = [], [], []
        for index, spec in enumerate(self.features(clips)):
            content = spec.shape[-1] - 1  # faster-whisper's content frames; none: no window
            for seek in range(0, content, WINDOW_FRAMES):
                size = min(WINDOW_FRAMES, content - seek)
                window = torch.zeros(spec.shape[0], WINDOW_FRAMES, device=self.device)
                window[:, :size] = spec[:, seek : seek + size]
                features.append(window)
                clip_of.append(index)
                first.append(seek == 0)
        if not features:
            return Windows(torch.zeros(0, self.filters.shape[0], WINDOW_FRAMES, device=self.device), [], [])
        return Windows(torch.stack(features), clip_of, first)


__all__ = ["LogMel", "Windows", "mel_filters"]
