"""VAD endpointing on real speech (the bundled voice), silence and noise."""

from __future__ import annotations

import numpy as np
import pytest

from speech.audio import resample
from speech.config import ConfigError, VADConfig
from speech.messages import SpeechEnded, SpeechPaused, SpeechResumed, SpeechStarted
from speech.vad import VoiceActivityDetector


def run(vad: VoiceActivityDetector, audio: np.ndarray, chunk: int = 480) -> list:
    events = []
    for i in range(0, len(audio), chunk):
        events += vad.process(audio[i : i + chunk])
    return events


def white_noise(seconds: float, amplitude: float, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.clip(amplitude * rng.standard_normal(round(seconds * rate)), -1, 1).astype(np.float32)


def test_one_utterance_per_question_with_exact_speech_end(question_clips) -> None:
    for clip in question_clips:
        audio = resample(clip.audio, clip.sample_rate, 16000)
        events = run(VoiceActivityDetector(), audio)
        assert [type(e) for e in events] == [SpeechStarted, SpeechEnded], clip.text
        started, ended = events
        assert abs(ended.speech_end_s - clip.speech_end_s) <= 0.060, clip.text
        assert abs(started.start_s - clip.speech_start_s) <= 0.100, clip.text
        assert ended.endpoint_s == pytest.approx(ended.speech_end_s + 0.5, abs=0.031)
        assert started.detected_s >= started.start_s + 0.09


@pytest.mark.parametrize(
    ("rate", "frame_ms"), [(8000, 10), (16000, 20), (32000, 30), (48000, 10), (48000, 30)]
)
def test_every_webrtc_rate_and_frame_size(question_clips, rate: int, frame_ms: int) -> None:
    clip = question_clips[1]
    audio = resample(clip.audio, clip.sample_rate, rate)
    events = run(VoiceActivityDetector(VADConfig(sample_rate=rate, frame_ms=frame_ms)), audio, 1000)
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded]
    assert abs(events[1].speech_end_s - clip.speech_end_s) <= 0.060


def test_events_do_not_depend_on_chunking(question_clips) -> None:
    audio = resample(question_clips[0].audio, question_clips[0].sample_rate, 16000)
    whole = VoiceActivityDetector().process(audio)
    rng = np.random.default_rng(0)
    vad, events, i = VoiceActivityDetector(), [], 0
    while i < len(audio):
        n = int(rng.integers(1, 2000))
        events += vad.process(audio[i : i + n])
        i += n
    assert events == whole and len(whole) == 2


def test_hangover_setting_moves_the_endpoint_not_speech_end(question_clips) -> None:
    audio = resample(question_clips[0].audio, question_clips[0].sample_rate, 16000)
    short = VoiceActivityDetector(VADConfig(hangover_ms=200)).process(audio)[-1]
    long = VoiceActivityDetector(VADConfig(hangover_ms=800)).process(audio)[-1]
    assert short.speech_end_s == long.speech_end_s
    assert short.endpoint_s == pytest.approx(short.speech_end_s + 0.2, abs=0.031)
    assert long.endpoint_s == pytest.approx(long.speech_end_s + 0.8, abs=0.031)


def test_start_hangover_ignores_a_short_burst(question_clips) -> None:
    """60 ms of real speech (webrtcvad smears it over 120-150 ms, by how this CPU's TTS rounded the
    clip) starts nothing if 240 ms are needed; 90 ms (the default) start it."""
    clip = question_clips[0]
    audio = resample(clip.audio, clip.sample_rate, 16000)
    mid = round((clip.speech_start_s + 0.3) * 16000)
    snippet = (audio[mid : mid + 960] * np.hanning(960)).astype(np.float32)
    burst = np.concatenate([np.zeros(8000, np.float32), snippet, np.zeros(16000, np.float32)])
    assert VoiceActivityDetector(VADConfig(start_ms=240, use_silero=False)).process(burst) == []
    started = VoiceActivityDetector(VADConfig(start_ms=90, use_silero=False)).process(burst)
    assert [type(e) for e in started] == [SpeechStarted, SpeechEnded]


def test_silence_gives_no_events() -> None:
    assert VoiceActivityDetector().process(np.zeros(48000, np.float32)) == []


@pytest.mark.parametrize("amplitude", [0.05, 0.3])
def test_silero_vetoes_white_noise_that_webrtcvad_takes_for_speech(amplitude: float) -> None:
    noise = white_noise(3.0, amplitude)
    assert VoiceActivityDetector(VADConfig(use_silero=False)).process(noise) != []
    assert VoiceActivityDetector(VADConfig(use_silero=True)).process(noise) == []


def test_commit_ends_the_utterance_now(question_clips) -> None:
    clip = question_clips[2]
    audio = resample(clip.audio, clip.sample_rate, 16000)
    vad = VoiceActivityDetector()
    cut = round((clip.speech_start_s + 1.0) * 16000)
    events = vad.process(audio[:cut])
    assert [type(e) for e in events] == [SpeechStarted] and vad.in_speech
    ended = vad.commit()
    assert ended is not None and ended.committed and ended.endpoint_s == pytest.approx(cut / 16000)
    assert ended.speech_end_s <= ended.endpoint_s and not vad.in_speech
    assert vad.commit() is None  # nothing left to commit


def test_utterances_are_numbered_and_reset_restarts_time(question_clips) -> None:
    clip = question_clips[0]
    audio = resample(clip.audio, clip.sample_rate, 16000)
    vad = VoiceActivityDetector()
    first = vad.process(audio)
    second = vad.process(audio)
    assert [e.utterance for e in first + second] == [0, 0, 1, 1]
    assert second[1].speech_end_s == pytest.approx(first[1].speech_end_s + len(audio) / 16000, abs=0.031)
    vad.reset()
    assert vad.position_s == 0.0 and vad.process(audio) == first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frame_ms": 25}, r"frame_ms=25: webrtcvad accepts frames of \(10, 20, 30\) ms"),
        ({"sample_rate": 44100}, r"sample_rate=44100: webrtcvad accepts \(8000, 16000, 32000, 48000\)"),
        ({"aggressiveness": 4}, "aggressiveness=4"),
        ({"hangover_ms": 0}, "hangover_ms=0"),
        ({"silero_threshold": 1.5}, "silero_threshold=1.5"),
    ],
)
def test_bad_vad_settings_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        VADConfig(**kwargs)


def test_a_short_pause_is_reported_and_speech_after_it_resumes_the_utterance(question_clips) -> None:
    first, second = (resample(c.audio, c.sample_rate, 16000) for c in question_clips[:2])
    lead = round(question_clips[1].speech_start_s * 16000)
    first_end = question_clips[0].speech_end_s
    gap = np.zeros(round(0.3 * 16000), np.float32)  # with the soft onset, a pause of about 0.35 s
    audio = np.concatenate([first[: round(first_end * 16000)], gap, second[lead:]])
    events = run(VoiceActivityDetector(VADConfig(pause_ms=200)), audio)
    assert [type(e) for e in events] == [SpeechStarted, SpeechPaused, SpeechResumed, SpeechPaused, SpeechEnded]
    _, paused, resumed, last_pause, ended = events
    assert abs(paused.speech_end_s - first_end) <= 0.060
    assert paused.paused_s == pytest.approx(paused.speech_end_s + 0.2, abs=0.031)
    assert resumed.resumed_s >= paused.paused_s and last_pause.speech_end_s == ended.speech_end_s
    assert ended.endpoint_s == pytest.approx(ended.speech_end_s + 0.5, abs=0.031)
    assert [type(e) for e in run(VoiceActivityDetector(), audio)] == [SpeechStarted, SpeechEnded]  # off by default


def test_end_turn_ends_the_utterance_at_the_pause(question_clips) -> None:
    clip = question_clips[0]
    audio = resample(clip.audio, clip.sample_rate, 16000)
    vad = VoiceActivityDetector(VADConfig(pause_ms=200))
    events = []
    for i in range(0, len(audio), 480):
        events += vad.process(audio[i : i + 480])
        if events and isinstance(events[-1], SpeechPaused):
            break
    ended = vad.end_turn()
    assert isinstance(ended, SpeechEnded) and not ended.committed
    assert ended.speech_end_s == events[-1].speech_end_s and ended.endpoint_s == pytest.approx(events[-1].paused_s, abs=0.031)
    assert vad.end_turn() is None and not vad.in_speech
