"""The page's audio conversions: microphone chunks to the session rate, uploads that are not audio."""

from __future__ import annotations

import numpy as np
import pytest

from speech.audio import write_wav
from web.audio import NotAudioError, StreamResampler, read_audio_file, to_mono_float


@pytest.mark.parametrize("src", [48000, 44100, 16000])
def test_chunked_resampling_is_seamless_and_keeps_the_tone(src: int) -> None:
    """A 440 Hz tone in 100 ms chunks comes out as one clean tone at 24 kHz (no clicks at the seams)."""
    tone = np.sin(2 * np.pi * 440 * np.arange(2 * src) / src).astype(np.float32)
    resampler = StreamResampler(src, 24000)
    out = np.concatenate([resampler.process(tone[i : i + src // 10]) for i in range(0, len(tone), src // 10)])
    assert abs(len(out) - 2 * 24000) <= 1
    delay = (63 - 1) / 2 / src  # the low-pass filter's group delay
    expected = np.sin(2 * np.pi * 440 * (np.arange(len(out)) / 24000 - delay))
    assert np.abs(out[200:-200] - expected[200:-200]).max() < 0.01


def test_frequencies_above_the_new_nyquist_are_filtered_out() -> None:
    src = 48000
    whistle = np.sin(2 * np.pi * 20000 * np.arange(src) / src).astype(np.float32)  # would alias to 4 kHz
    out = StreamResampler(src, 24000).process(whistle)
    assert np.sqrt(np.mean(out[200:] ** 2)) < 0.01


def test_stereo_int16_becomes_mono_float() -> None:
    stereo = np.array([[32767, 32767], [-32768, 0]], np.int16)
    assert to_mono_float(stereo) == pytest.approx([32767 / 32768, -0.5])


def test_an_uploaded_recording_is_read_and_a_text_file_is_refused(tmp_path) -> None:
    wav = write_wav(tmp_path / "question.wav", 0.5 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000), 16000)
    pcm = read_audio_file(wav, 24000)
    assert abs(len(pcm) // 2 - 24000) <= 1
    notes = tmp_path / "notes.wav"
    notes.write_text("not audio at all")
    with pytest.raises(NotAudioError, match="notes.wav is not an audio file"):
        read_audio_file(notes, 24000)
