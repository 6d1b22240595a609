"""One caller cannot hold the shared ASR worker: the worker serves sessions round robin, and an
utterance that goes on past ``VADConfig.max_utterance_s`` is cut and transcribed as a turn."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from speech.asr.backend import ASRBackend, Decoded
from speech.asr.session import ASRSession
from speech.asr.worker import ASRJob, ASRQueuePolicy, ASRWorker
from speech.audio import resample
from speech.config import ASRConfig, VADConfig
from speech.messages import SpeechEnded, SpeechStarted, Transcript
from tests.speech.test_asr_streaming import chunks


class GatedBackend(ASRBackend):
    """Holds its first decode until ``gate`` is set, so the test queues jobs behind it."""

    supported_languages = ("en",)

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()

    def transcribe(self, audio, prefix="", language=None) -> Decoded:
        self.started.set()
        assert self.gate.wait(60)
        return Decoded("x", "en")


def run_order(submit_behind_first, jobs: int, policy: ASRQueuePolicy = ASRQueuePolicy()) -> list[tuple[str, bool, int]]:
    """(session, is_final, utterance) in the order decoded, for the ``jobs`` jobs that
    ``submit_behind_first(worker, job)`` queues while session A's first partial is being decoded."""
    order: list[tuple[str, bool, int]] = []
    all_done = threading.Event()
    backend = GatedBackend()
    with ASRWorker(backend, policy=policy) as worker:
        names = {worker.new_session_id(): name for name in "ABC"}
        ids = {name: sid for sid, name in names.items()}

        def job(name: str, final: bool, utterance: int = 0) -> ASRJob:
            def done(j: ASRJob, result, queue_s: float, decode_s: float) -> None:
                order.append((names[j.session], j.is_final, j.utterance))
                if len(order) == 1 + jobs:
                    all_done.set()

            return ASRJob(ids[name], utterance, final, np.zeros(1600, np.float32), "", "en", 0.1, done)

        worker.submit(job("A", False))
        assert backend.started.wait(60)
        submit_behind_first(worker, job)
        backend.gate.set()
        assert all_done.wait(60), order
    return order[1:]


def test_a_session_just_served_waits_behind_the_others_partials() -> None:
    """A (speaking on, its partial just decoded) queued its next partial before B did: B goes first;
    finals still go before partials."""
    def queue(worker, job) -> None:
        worker.submit(job("A", False))
        worker.submit(job("B", False))
        worker.submit(job("C", True))

    assert run_order(queue, 3) == [("C", True, 0), ("B", False, 0), ("A", False, 0)]


def test_finals_take_turns_and_a_sessions_own_finals_keep_their_order() -> None:
    def queue(worker, job) -> None:
        worker.submit(job("A", True, 0))
        worker.submit(job("A", True, 1))
        worker.submit(job("B", True, 0))

    assert run_order(queue, 3) == [("B", True, 0), ("A", True, 0), ("A", True, 1)]


def test_a_closed_sessions_turn_is_forgotten() -> None:
    with ASRWorker(GatedBackend()) as worker:
        session = ASRSession(worker, lambda event: None, ASRConfig(language="en"), VADConfig(use_silero=False))
        assert session.id in worker._last_turn
        session.close()
        assert session.id not in worker._last_turn


def test_forty_seconds_of_speech_is_cut_into_a_turn_at_thirty(question_clips, whisper_tiny, tiny_config) -> None:
    """40 s of speech with no pause: the real VAD ends the first utterance at 30 s (``cut``), the
    real tiny Whisper transcribes it as a final, and the remaining speech is the next utterance."""
    speech = []
    for clip in question_clips:  # each question's speech without its silences, back to back
        start, end = round(clip.speech_start_s * clip.sample_rate), round(clip.speech_end_s * clip.sample_rate)
        speech.append(resample(clip.audio[start:end], clip.sample_rate, 16000))
    audio = np.concatenate(speech * 4)[: 40 * 16000]
    audio = np.concatenate([audio, np.zeros(2 * 16000, np.float32)])
    events: list = []
    finals = threading.Semaphore(0)

    def on_event(event) -> None:
        events.append(event)
        if isinstance(event, Transcript) and event.is_final:
            finals.release()

    config = replace(tiny_config, partial_interval_s=None)
    vad = VADConfig(hangover_ms=1500, max_utterance_s=30.0)  # the clips' joins and word gaps are shorter
    with ASRWorker(whisper_tiny) as worker:
        session = ASRSession(worker, on_event, config, vad)
        for chunk in chunks(audio, 16000):
            session.feed(chunk)
        assert finals.acquire(timeout=120) and finals.acquire(timeout=120), events
    vad_events = [e for e in events if not isinstance(e, Transcript)]
    assert [type(e) for e in vad_events] == [SpeechStarted, SpeechEnded, SpeechStarted, SpeechEnded], events
    first, second = vad_events[1], vad_events[3]
    assert first.cut and not second.cut
    assert abs(first.endpoint_s - first.start_s - 30.0) <= 0.03
    assert 8.0 <= second.speech_end_s - second.start_s <= 10.5  # the other 10 s, less the restart
    texts = {e.utterance: e.text for e in events if isinstance(e, Transcript)}
    assert sorted(texts) == [0, 1] and texts[1]
    heard = set(texts[0].lower().replace(",", " ").replace("?", " ").replace(".", " ").split())
    spoken = question_clips[0].text.lower().rstrip("?").split()
    assert len(texts[0].split()) >= 40 and sum(w in heard for w in spoken) >= len(spoken) // 2, texts[0]
