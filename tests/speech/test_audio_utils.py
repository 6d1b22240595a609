"""Audio utilities: conversions, validation errors, resampling, framing, WAV I/O."""

from __future__ import annotations

import numpy as np
import pytest

from speech.audio import (
    SUPPORTED_RATES,
    AudioFormatError,
    Resampler,
    check_rate,
    decode_wav,
    read_wav,
    resample,
    split_frames,
    to_float32,
    to_pcm16,
    write_wav,
)


def test_pcm16_bytes_and_float_round_trip() -> None:
    pcm = np.array([0, 1, -1, 32767, -32768, 1000], np.int16)
    floats = to_float32(pcm.astype("<i2").tobytes())
    assert floats.dtype == np.float32
    assert floats[3] == pytest.approx(32767 / 32768) and floats[4] == -1.0
    np.testing.assert_array_equal(to_pcm16(floats[:3]), pcm[:3])  # small values survive
    np.testing.assert_array_equal(to_pcm16(pcm), pcm)  # int16 passes through unchanged
    assert to_pcm16(np.array([2.0, -2.0], np.float32)).tolist() == [32767, -32767]  # clipped


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"\x00\x01\x02", "even number of bytes"),
        (b"", "empty"),
        (np.zeros(0, np.float32), "empty"),
        (np.array([0.1, np.nan, 0.2], np.float32), "NaN or infinite"),
        (np.array([0.1, np.inf], np.float64), "NaN or infinite"),
        (np.zeros((2, 100), np.float32), "mono"),
        (np.zeros(10, np.int32), "int16 PCM or float32"),
        ([0.1, 0.2], "PCM16 bytes or a numpy array"),
    ],
)
def test_bad_audio_is_rejected_with_a_clear_message(bad: object, message: str) -> None:
    with pytest.raises(AudioFormatError, match=message):
        to_float32(bad)  # type: ignore[arg-type]


def test_column_vectors_are_accepted_as_mono() -> None:
    assert to_float32(np.zeros((5, 1), np.float32)).shape == (5,)


def test_check_rate_names_what_is_accepted() -> None:
    assert check_rate(48000) == 48000
    with pytest.raises(AudioFormatError, match=r"unsupported sample rate 11025 Hz; accepted: 8000"):
        check_rate(11025)
    with pytest.raises(AudioFormatError, match="integer"):
        check_rate(16000.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("src", SUPPORTED_RATES)
@pytest.mark.parametrize("dst", [8000, 16000, 24000, 48000])
def test_resample_keeps_length_and_timing(src: int, dst: int) -> None:
    """A tone burst at 0.50-0.60 s stays at 0.50-0.60 s whatever the rates."""
    t = np.arange(src) / src
    x = np.where((t >= 0.5) & (t < 0.6), 0.5 * np.sin(2 * np.pi * 440 * t), 0).astype(np.float32)
    y = resample(x, src, dst)
    assert len(y) == dst
    loud = np.nonzero(np.abs(y) > 0.05)[0] / dst
    assert loud[0] == pytest.approx(0.5, abs=0.002) and loud[-1] == pytest.approx(0.6, abs=0.002)
    assert np.abs(y).max() == pytest.approx(0.5, abs=0.03)


def test_streaming_resampler_matches_whole_clip() -> None:
    rng = np.random.default_rng(0)
    x = (0.1 * rng.standard_normal(48000)).astype(np.float32)
    stream = Resampler(48000, 16000)
    pieces = [stream.process(x[i : i + 777]) for i in range(0, len(x), 777)] + [stream.flush()]
    streamed = np.concatenate(pieces)
    whole = resample(x, 48000, 16000)
    assert abs(len(streamed) - len(whole)) <= 1
    n = min(len(streamed), len(whole))
    np.testing.assert_allclose(streamed[:n], whole[:n], atol=1e-4)


def test_resampler_at_the_same_rate_is_a_pass_through() -> None:
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    np.testing.assert_array_equal(Resampler(16000, 16000).process(x), x)


def test_split_frames() -> None:
    frames, rest = split_frames(np.arange(10), 3)
    assert frames.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and rest.tolist() == [9]
    with pytest.raises(AudioFormatError, match="positive"):
        split_frames(np.arange(3), 0)


def test_wav_round_trip(tmp_path) -> None:
    x = (0.3 * np.sin(np.arange(2400) / 5)).astype(np.float32)
    path = write_wav(tmp_path / "a.wav", x, 24000)
    y, rate = read_wav(path)
    assert rate == 24000 and len(y) == len(x)
    np.testing.assert_allclose(y, x, atol=1 / 16000)


def test_decode_wav_rejects_what_it_cannot_read(tmp_path) -> None:
    import wave

    with pytest.raises(AudioFormatError, match="not a readable WAV"):
        decode_wav(b"RIFF nonsense")
    path = tmp_path / "u8.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(8000)
        w.writeframes(bytes(100))
    with pytest.raises(AudioFormatError, match="16-bit PCM, got 8-bit"):
        read_wav(path)


def test_stereo_wav_is_mixed_to_mono(tmp_path) -> None:
    import wave

    path = tmp_path / "stereo.wav"
    left_right = np.array([[1000, 3000], [-2000, 0]], "<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(left_right.tobytes())
    y, _ = read_wav(path)
    np.testing.assert_allclose(y, [2000 / 32768, -1000 / 32768])
