"""Streaming ASR with real Whisper models on questions spoken by the bundled voice."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from speech.asr.backend import ASRBackend, ASRError, Decoded, FasterWhisperBackend
from speech.asr.session import ASRSession, AsyncASRSession
from speech.asr.stable_prefix import StablePrefix
from speech.asr.worker import ASRJob, ASRWorker
from speech.audio import AudioFormatError, resample
from speech.config import ASRConfig, ConfigError, TTSConfig, VADConfig
from speech.messages import SpeechEnded, SpeechStarted, Transcript, TranscriptionFailed
from speech.tts import load_tts


def chunks(audio: np.ndarray, rate: int, ms: int = 20) -> list[bytes]:
    """The clip as PCM16 little-endian byte chunks, as a client would send it."""
    pcm = np.round(np.clip(audio, -1, 1) * 32767).astype("<i2")
    step = rate * ms // 1000
    return [pcm[i : i + step].tobytes() for i in range(0, len(pcm), step)]


def transcribe(worker: ASRWorker, config: ASRConfig, audio: np.ndarray, rate: int,
               received: dict[int, float] | None = None, **kw) -> list:
    """Feed a whole clip through a session as fast as possible; return its events (and, into
    ``received``, when each transcript arrived: id(transcript) -> perf_counter)."""
    events: list = []
    finished = threading.Event()

    def on_event(event) -> None:
        if received is not None and isinstance(event, Transcript):
            received[id(event)] = time.perf_counter()
        events.append(event)
        if isinstance(event, TranscriptionFailed) or getattr(event, "is_final", False):
            finished.set()

    session = ASRSession(worker, on_event, config, input_rate=rate, **kw)
    for chunk in chunks(audio, rate):
        session.feed(chunk)
    assert finished.wait(60), f"no final transcript; events: {events}"
    return events


def white_noise(seconds: float, amplitude: float, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(2)
    return np.clip(amplitude * rng.standard_normal(round(seconds * rate)), -1, 1).astype(np.float32)


def assert_stable_prefixes(texts: list[str]) -> None:
    for i, text in enumerate(texts):
        for later in texts[i + 1 :]:
            assert later.startswith(text), (text, later)


# -- acceptance ---------------------------------------------------------------------------------


def test_round_trip_ten_questions(question_clips, whisper_base, base_config, wer) -> None:
    """hibari speaks ten handbook questions; VAD finds one utterance each with speech_end within
    60 ms of the truth; Whisper base transcribes them with a word error rate of at most 10%."""
    config = replace(base_config, partial_interval_s=None)
    pairs = []
    with ASRWorker(whisper_base) as worker:
        for clip in question_clips:
            events = transcribe(worker, config, clip.audio, clip.sample_rate)
            assert [type(e) for e in events] == [SpeechStarted, SpeechEnded, Transcript], events
            ended, final = events[1], events[2]
            assert abs(ended.speech_end_s - clip.speech_end_s) <= 0.060, clip.text
            assert final.is_final and final.language == "en"
            pairs.append((clip.text, final.text))
    assert wer(pairs) <= 0.10, pairs


async def test_partials_arrive_during_speech_and_are_stable_prefixes(
    long_clips, whisper_tiny, tiny_config, wer
) -> None:
    """Fed in real time, an utterance over 2 s gets partials before the user stops, and every
    partial is a prefix of the later partials and of the final."""
    longest = sorted(long_clips, key=lambda c: c.speech_end_s - c.speech_start_s)[-2:]
    with ASRWorker(whisper_tiny) as worker:
        for clip in longest:
            session = AsyncASRSession(worker, tiny_config, input_rate=clip.sample_rate)
            fed_s = 0.0
            arrivals: list[tuple[float, Transcript]] = []

            async def listen() -> None:
                async for event in session:
                    if isinstance(event, Transcript):
                        arrivals.append((fed_s, event))
                        if event.is_final:
                            return

            listener = asyncio.create_task(listen())
            for chunk in chunks(clip.audio, clip.sample_rate, ms=100):
                session.feed(chunk)
                fed_s += len(chunk) / 2 / clip.sample_rate
                await asyncio.sleep(0.1)  # real time
            await asyncio.wait_for(listener, 30)
            partials = [(t, e) for t, e in arrivals if not e.is_final]
            final = arrivals[-1][1]
            assert partials, f"no partial for {clip.text!r}"
            first_time, first = partials[0]
            assert first_time < clip.speech_end_s and first.audio_end_s < clip.speech_end_s
            assert first.text
            assert_stable_prefixes([e.text for _, e in partials] + [final.text])
            assert wer([(clip.text, final.text)]) <= 0.25  # tiny.en: fast, not the most accurate


async def speak_into(worker: ASRWorker, config: ASRConfig, clip, delay: float) -> tuple[str, list[str]]:
    """One user: after ``delay``, ``clip`` streamed at real-time pace in 100 ms packets through its
    own session on ``worker``; (final text, partial texts)."""
    await asyncio.sleep(delay)
    session = AsyncASRSession(worker, config, input_rate=clip.sample_rate)
    partial_texts: list[str] = []

    async def listen() -> None:
        async for event in session:
            if isinstance(event, Transcript) and not event.is_final:
                partial_texts.append(event.text)

    listener = asyncio.create_task(listen())
    for chunk in chunks(clip.audio, clip.sample_rate, ms=100):
        session.feed(chunk)
        await asyncio.sleep(0.1)
    final = await asyncio.wait_for(session.final(), 60)
    session.close()
    await listener
    return final.text, partial_texts


async def test_four_sessions_share_one_model(long_clips, whisper_base, base_config, wer) -> None:
    """Four users speak at once (real time) through one shared Whisper base: all finals right."""
    clips = long_clips[:4]

    with ASRWorker(whisper_base, queue_size=base_config.queue_size) as worker:
        results = await asyncio.gather(*(speak_into(worker, base_config, c, 0.05 * i) for i, c in enumerate(clips)))
        stats = worker.stats
    assert wer([(c.text, text) for c, (text, _) in zip(clips, results)]) <= 0.10, results
    for text, partial_texts in results:
        assert_stable_prefixes(partial_texts + [text])
    assert stats.submitted_finals == stats.processed_finals == 4
    assert stats.max_queued_partials <= base_config.queue_size


def test_queue_bound_holds_under_a_burst(question_clips, whisper_tiny) -> None:
    """Finals go first and are never dropped; partials beyond the bound, superseded partials and
    partials whose final is queued are dropped."""
    clip = question_clips[0]
    audio = resample(clip.audio, clip.sample_rate, 16000)[: 2 * 16000]
    order: list[tuple[bool, int]] = []
    texts: dict[int, str] = {}
    all_done = threading.Event()

    def on_done(job: ASRJob, result, queue_s: float, decode_s: float) -> None:
        order.append((job.is_final, job.session))
        if job.is_final:
            texts[job.session] = result.text
        if len(order) == 4:
            all_done.set()

    def job(session: int, final: bool) -> ASRJob:
        return ASRJob(session, 0, final, audio, "", "en", 2.0, on_done)

    with ASRWorker(whisper_tiny, queue_size=2) as worker:
        worker.submit(job(100, True))
        while worker.stats.queued_finals:  # wait until the worker is busy with it
            time.sleep(0.001)
        accepted = [worker.submit(job(s, False)) for s in range(8)]  # a burst of partials
        assert worker.submit(job(0, False))  # newer partial of session 0 supersedes its first
        worker.submit(job(1, True))  # session 1's final removes its queued partial
        worker.submit(job(5, True))
        assert all_done.wait(30)
        stats = worker.stats
    assert accepted == [True, True, False, False, False, False, False, False]
    assert order == [(True, 100), (True, 1), (True, 5), (False, 0)]
    assert stats.max_queued_partials == 2
    assert stats.dropped_partials == 6 + 1 + 1
    assert stats.submitted_finals == stats.processed_finals == 3 and stats.processed_partials == 1
    assert all(texts[s] for s in (100, 1, 5))


def test_no_partials_are_decoded_once_the_speaker_pauses(question_clips, whisper_tiny, tiny_config) -> None:
    """With a 2 s hangover, partials every 0.25 s would go on for 2 s of silence; they stop."""
    clip = question_clips[1]
    audio = np.concatenate([clip.audio, np.zeros(3 * clip.sample_rate, np.float32)])
    config = replace(tiny_config, partial_interval_s=0.25)
    with ASRWorker(whisper_tiny) as worker:
        events = transcribe(
            worker, config, audio, clip.sample_rate, vad=VADConfig(hangover_ms=2000)
        )
        submitted = worker.stats.submitted_partials
    speech = events[1].speech_end_s - events[0].start_s
    assert events[1].endpoint_s - events[1].speech_end_s == pytest.approx(2.0, abs=0.031)
    assert 1 <= submitted <= (speech - config.min_partial_audio_s) / 0.25 + 2


def test_silence_and_white_noise_give_no_transcript(whisper_base, base_config) -> None:
    with ASRWorker(whisper_base) as worker:
        for audio in (np.zeros(3 * 16000, np.float32), white_noise(3, 0.05), white_noise(3, 0.3)):
            events: list = []
            session = ASRSession(worker, events.append, base_config)
            for chunk in chunks(audio, 16000):
                session.feed(chunk)
            assert events == [] and session.commit() is None
        assert worker.stats.submitted_finals == worker.stats.submitted_partials == 0

        # Without Silero, webrtcvad takes the noise for speech; the Whisper guards still leave
        # the transcript empty.
        events = []
        done = threading.Event()
        session = ASRSession(
            worker,
            lambda e: (events.append(e), getattr(e, "is_final", False) and done.set()),
            base_config,
            VADConfig(use_silero=False),
        )
        for chunk in chunks(white_noise(3, 0.05), 16000):
            session.feed(chunk)
        assert isinstance(events[0], SpeechStarted)
        assert session.commit() is not None and done.wait(30)
        transcripts = [e for e in events if isinstance(e, Transcript)]
        assert [t.text for t in transcripts] == [""] and transcripts[0].is_final


def babble(clips, first: int, count: int) -> np.ndarray:
    """Several questions played backwards at once: speech-like sound that is not words."""
    parts = [resample(c.audio, c.sample_rate, 16000)[::-1] for c in clips[first : first + count]]
    n = max(len(p) for p in parts)
    return (sum(np.pad(p, (0, n - len(p))) for p in parts) / count).astype(np.float32)


def test_guards_remove_what_whisper_makes_up(question_clips, whisper_base, base_config) -> None:
    """Unguarded, Whisper base writes words for silence, noise, babble and Mandarin read as
    English; guarded, nothing. faster-whisper's no-speech rule catches silence and noise; the
    segment rules here catch the rest (low log-probability, repetition loops)."""
    unguarded = FasterWhisperBackend(
        replace(
            base_config,
            no_speech_threshold=1.0,
            log_prob_threshold=-1e9,
            compression_ratio_threshold=1e9,
            reject_repeated_sentences=False,
        )
    )
    mandarin = load_tts(TTSConfig(backend="espeak", language="zh")).synthesize(
        "年假怎么申请？请登录人事系统，选择请假类型，然后提交。"
    )
    cases = {
        "silence": (np.zeros(2 * 16000, np.float32), 0),
        "noise": (white_noise(2, 0.05), 0),
        "babble of two": (babble(question_clips, 0, 2), 1),
        "babble of three": (babble(question_clips, 3, 3), 1),
        "Mandarin as English": (resample(mandarin.pcm, mandarin.sample_rate, 16000), 1),
    }
    for name, (audio, rejected_here) in cases.items():
        assert unguarded.transcribe(audio, language="en").text != "", name
        decoded = whisper_base.transcribe(audio, language="en")
        assert decoded.text == "" and decoded.rejected_segments == rejected_here, (name, decoded)


def test_a_sentence_said_twice_in_a_row_is_a_repetition_loop() -> None:
    from speech.asr.backend import repeats_a_sentence

    assert repeats_a_sentence("I am going out for a little while. I am going out for a little while. See you in a month.")
    assert repeats_a_sentence("请登录人事系统。请登录人事系统。")
    assert not repeats_a_sentence("Yes. Yes. How do I apply for annual leave?")
    assert not repeats_a_sentence("How do I apply for annual leave? And how many days do I get?")
    assert not repeats_a_sentence("Is it paid? Is it paid by the company?")


# -- languages, rates, commit, errors -----------------------------------------------------------


def test_language_auto_en_zh(question_clips, whisper_base) -> None:
    clip = question_clips[0]
    audio = resample(clip.audio, clip.sample_rate, 16000)
    auto = whisper_base.transcribe(audio, language="auto")
    assert auto.language == "en" and auto.text.lower().startswith("how do i apply")
    assert whisper_base.transcribe(audio, language="zh").language == "zh"
    with pytest.raises(ConfigError, match="language 'xx' is not supported"):
        whisper_base.check_language("xx")


def test_english_only_model_refuses_chinese(whisper_tiny, tiny_config) -> None:
    with ASRWorker(whisper_tiny) as worker:
        with pytest.raises(ConfigError, match="language 'zh' is not supported by this ASR model"):
            ASRSession(worker, print, replace(tiny_config, language="zh"))
    with pytest.raises(ConfigError, match="language 'zh'"):
        FasterWhisperBackend(replace(tiny_config, language="zh"))


@pytest.mark.parametrize("rate", [8000, 44100, 48000])
def test_input_sample_rates(question_clips, whisper_tiny, tiny_config, rate: int, wer) -> None:
    clip = question_clips[1]
    audio = resample(clip.audio, clip.sample_rate, rate)
    with ASRWorker(whisper_tiny) as worker:
        events = transcribe(worker, replace(tiny_config, partial_interval_s=None), audio, rate)
    assert abs(events[1].speech_end_s - clip.speech_end_s) <= 0.060
    assert wer([(clip.text, events[-1].text)]) <= 0.25


def test_commit_ends_the_turn_early(question_clips, whisper_tiny, tiny_config) -> None:
    clip = question_clips[2]
    cut = round((clip.speech_start_s + 1.5) * clip.sample_rate)
    events: list = []
    done = threading.Event()
    with ASRWorker(whisper_tiny) as worker:
        session = ASRSession(
            worker,
            lambda e: (events.append(e), getattr(e, "is_final", False) and done.set()),
            replace(tiny_config, partial_interval_s=None),
            input_rate=clip.sample_rate,
        )
        for chunk in chunks(clip.audio[:cut], clip.sample_rate):
            session.feed(chunk)
        ended = session.commit()
        assert ended is not None and ended.committed
        assert ended.endpoint_s == pytest.approx(cut / clip.sample_rate, abs=0.01)
        assert done.wait(30)
    final = events[-1]
    assert final.is_final and final.text and final.audio_end_s <= ended.endpoint_s


def test_bad_input_raises_and_the_session_carries_on(question_clips, whisper_tiny, tiny_config) -> None:
    clip = question_clips[0]
    events: list = []
    done = threading.Event()
    with ASRWorker(whisper_tiny) as worker:
        with pytest.raises(AudioFormatError, match=r"unsupported sample rate 11025 Hz"):
            ASRSession(worker, events.append, tiny_config, input_rate=11025)
        session = ASRSession(
            worker,
            lambda e: (events.append(e), getattr(e, "is_final", False) and done.set()),
            replace(tiny_config, partial_interval_s=None),
            input_rate=clip.sample_rate,
        )
        pieces = chunks(clip.audio, clip.sample_rate)
        half = len(pieces) // 2
        for chunk in pieces[:half]:
            session.feed(chunk)
        with pytest.raises(AudioFormatError, match="even number of bytes"):
            session.feed(b"\x00\x01\x02")
        with pytest.raises(AudioFormatError, match="NaN"):
            session.feed(np.array([0.0, np.nan, 0.1], np.float32))
        with pytest.raises(AudioFormatError, match="empty"):
            session.feed(b"")
        for chunk in pieces[half:]:
            session.feed(chunk)
        assert done.wait(30)
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded, Transcript]
    assert events[-1].text.lower().startswith("how do i apply")
    assert abs(events[1].speech_end_s - clip.speech_end_s) <= 0.060  # stream time unharmed


class CrashingBackend(ASRBackend):
    """Stands in for a model crash (e.g. out of GPU memory), which real CPU models won't do."""

    supported_languages = ("en",)

    def transcribe(self, audio, prefix="", language=None) -> Decoded:
        raise RuntimeError("model crashed")


async def test_a_failed_decode_is_reported_and_the_worker_goes_on(question_clips, tiny_config) -> None:
    clip = question_clips[0]
    with ASRWorker(CrashingBackend()) as worker:
        for _ in range(2):
            session = AsyncASRSession(worker, tiny_config, input_rate=clip.sample_rate)
            for chunk in chunks(clip.audio, clip.sample_rate):
                session.feed(chunk)
            with pytest.raises(ASRError, match="RuntimeError: model crashed"):
                await asyncio.wait_for(session.final(), 10)
        assert worker.stats.failed >= 2


def test_closed_worker_decodes_queued_finals_and_refuses_new_jobs(question_clips, whisper_tiny) -> None:
    audio = resample(question_clips[0].audio, question_clips[0].sample_rate, 16000)
    results = []
    worker = ASRWorker(whisper_tiny)
    for session in range(3):
        worker.submit(ASRJob(session, 0, True, audio, "", "en", 1.0, lambda j, r, q, d: results.append(r)))
    worker.close()
    assert len(results) == 3 and all(isinstance(r, Decoded) and r.text for r in results)
    with pytest.raises(ASRError, match="closed"):
        worker.submit(ASRJob(9, 0, True, audio, "", "en", 1.0, lambda *a: None))


def test_worker_from_config_and_a_closed_session(question_clips, tiny_config) -> None:
    """``from_config`` loads the backend with the configured bound; a closed session is silent."""
    clip = question_clips[0]
    events: list = []
    with ASRWorker.from_config(replace(tiny_config, queue_size=3)) as worker:
        assert worker.queue_size == 3 and isinstance(worker.backend, FasterWhisperBackend)
        session = ASRSession(worker, events.append, tiny_config, input_rate=clip.sample_rate)
        session.close()
        for chunk in chunks(clip.audio, clip.sample_rate):
            session.feed(chunk)
    assert worker.stats.processed_finals == 1 and events == []


def test_bad_asr_settings_are_rejected(tmp_path: Path, whisper_tiny) -> None:
    with pytest.raises(ConfigError, match="model_path is not set"):
        FasterWhisperBackend(ASRConfig())
    with pytest.raises(ConfigError, match="no model.bin in it"):
        FasterWhisperBackend(ASRConfig(model_path=tmp_path))
    with pytest.raises(ConfigError, match="available backends are"):
        ASRConfig(backend="whisper.cpp")
    with pytest.raises(ConfigError, match="VADConfig.sample_rate=48000"):
        with ASRWorker(whisper_tiny) as worker:
            ASRSession(worker, print, ASRConfig(), VADConfig(sample_rate=48000))


# -- the stable-prefix rule ---------------------------------------------------------------------


def test_stable_prefix_needs_two_agreeing_decodes_and_holds_back_the_last_word() -> None:
    stable = StablePrefix()
    assert not stable.update("How many days")  # one decode proves nothing
    assert stable.update("How many days of annual") and stable.text == "How many days"
    # "annual" was the newest word, held back; now a second decode puts "of" in agreement too
    assert stable.update("How many days of annual") and stable.text == "How many days of"
    assert stable.update("How many days of annual leaf") and stable.text == "How many days of annual"
    assert not stable.update("How many days of annual leave is")  # "leaf" != "leave"
    assert not stable.update("Something else")  # a decode must start with the stable text
    assert stable.text == "How many days of annual"


def test_stable_prefix_counts_chinese_characters_as_units() -> None:
    stable = StablePrefix()
    stable.update("年假怎么")
    assert stable.update("年假怎么申请") and stable.text == "年假怎么"


def test_a_transcript_says_when_its_decode_ended(question_clips, whisper_tiny, tiny_config) -> None:
    """``decoded_at`` is the instant the decode ended: after the audio was fed and its queue and
    decode times, before the transcript reached its listener, which stamps when it got it. The
    timeline's hand-off starts there, so queue + decode + hand-off cover the ASR stage even when a
    batch's later results wait for the earlier ones' callbacks."""
    clip = question_clips[0]
    received: dict[int, float] = {}
    start = time.perf_counter()
    with ASRWorker(whisper_tiny) as worker:
        events = transcribe(worker, tiny_config, clip.audio, clip.sample_rate, received)
    transcripts = [e for e in events if isinstance(e, Transcript)]
    assert transcripts and transcripts[-1].is_final
    for t in transcripts:
        assert t.decode_s > 0 and t.queue_s >= 0
        assert start + t.queue_s + t.decode_s <= t.decoded_at <= received[id(t)]
