"""The hearing front end (resampler + VAD) in worker processes hears as it does in this process.

Real worker processes (spawned), the real resampler, webrtcvad and Silero, a spoken question.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from speech.asr.session import AsyncASRSession
from speech.asr.worker import ASRWorker
from speech.audio import AudioFormatError, resample
from speech.config import VADConfig
from speech.front_end import FrontEndError, FrontEndPool, LocalFrontEnd, RemoteFrontEnd, _Request
from speech.messages import SpeechEnded, SpeechStarted
from tests.speech.test_asr_streaming import chunks

RATE = 24000  # the Realtime API's


@pytest.fixture(scope="module")
def pool():
    pool = FrontEndPool(2)
    yield pool
    pool.close()


def question_at_24k(clip) -> np.ndarray:
    """A spoken question with a second of silence after it, at 24 kHz."""
    return np.concatenate([resample(clip.audio, clip.sample_rate, RATE), np.zeros(RATE, np.float32)])


def hear_all(front, audio: np.ndarray) -> tuple[np.ndarray, list]:
    """``audio`` in 40 ms PCM16 packets, as a Realtime client sends it."""
    samples, events = [], []
    for packet in chunks(audio, RATE, ms=40):
        s, e = front.hear(packet)
        samples.append(s)
        events += e
    return np.concatenate(samples), events


def test_a_worker_process_hears_what_this_process_hears(question_clips, pool) -> None:
    """Same 16 kHz samples (to the bit) and the same events, packet by packet; commit and close alike."""
    pcm = question_at_24k(question_clips[0])
    vad = VADConfig()
    local, remote = LocalFrontEnd(RATE, vad), pool.open(RATE, vad)
    assert isinstance(remote, RemoteFrontEnd)
    here, there = hear_all(local, pcm), hear_all(remote, pcm)
    np.testing.assert_array_equal(here[0], there[0])
    assert here[1] == there[1]
    assert [type(e) for e in there[1]] == [SpeechStarted, SpeechEnded]
    assert remote.silence_s == local.silence_s == 0.0  # the utterance ended: none in progress
    speech = pcm[: RATE * 3 // 2]  # the question's start: an utterance in progress, then commit
    for front in (local, remote):
        hear_all(front, speech)
    assert local.silence_s == remote.silence_s and remote.commit() == local.commit() is not None
    assert remote.end_turn() is None and remote.commit() is None  # nothing in progress any more
    local.close()
    remote.close()
    remote.close()  # twice: harmless


def test_bad_audio_is_refused_here_and_the_stream_goes_on(question_clips, pool) -> None:
    front = pool.open(RATE, VADConfig(use_silero=False))
    with pytest.raises(AudioFormatError, match="even number of bytes"):
        front.hear(b"\x01\x02\x03")
    with pytest.raises(AudioFormatError, match="NaN or infinite"):
        front.hear(np.array([0.0, np.nan], np.float32))
    samples, _ = front.hear(np.zeros(960, np.int16).tobytes())
    assert len(samples) > 0
    front.close()


def test_a_worker_process_that_dies_fails_its_streams_clearly_and_spares_the_others() -> None:
    pool = FrontEndPool(2)
    try:
        first, second = pool.open(RATE, VADConfig(use_silero=False)), pool.open(RATE, VADConfig(use_silero=False))
        pool.processes[0].kill()
        pool.processes[0].join(10)
        with pytest.raises(FrontEndError, match="speech-front-end-0 stopped"):
            first.hear(np.zeros(960, np.int16).tobytes())
        assert len(second.hear(np.zeros(960, np.int16).tobytes())[0]) > 0  # the other process goes on
        first.close()  # a stream whose process is gone closes quietly
        third = pool.open(RATE, VADConfig(use_silero=False))  # lands on the dead one's place: restarted
        assert len(third.hear(np.zeros(960, np.int16).tobytes())[0]) > 0 and pool.processes[0].is_alive()
    finally:
        pool.close()
    assert not any(p.is_alive() for p in pool.processes)


async def test_sessions_with_front_end_processes_transcribe_as_in_process(question_clips, whisper_tiny, tiny_config) -> None:
    """Two sessions of a worker whose front ends run in a process: the finals equal those of the
    same audio through a worker whose front ends run here."""
    from tests.speech.test_asr_streaming import speak_into

    clips = question_clips[:2]
    finals = {}
    for processes in (0, 1):
        with ASRWorker(whisper_tiny, front_end_processes=processes) as worker:
            config = replace(tiny_config, partial_interval_s=None)
            results = await asyncio.gather(*(speak_into(worker, config, clip, 0.05 * i) for i, clip in enumerate(clips)))
            finals[processes] = [text for text, _ in results]
            assert isinstance(AsyncASRSession(worker, config, input_rate=RATE)._session._front,
                              RemoteFrontEnd if processes else LocalFrontEnd)  # fmt: skip
    assert finals[1] == finals[0] and all(finals[1])


def test_a_worker_process_that_hangs_is_stopped_and_its_stream_fails_clearly() -> None:
    """A worker process that does not answer (stopped with SIGSTOP here) within the reply timeout
    is killed; the call raises FrontEndError saying so, and the next stream there gets a new process."""
    import os
    import signal

    pool = FrontEndPool(1)
    try:
        front = pool.open(RATE, VADConfig(use_silero=False))
        hung = pool.processes[0]
        os.kill(hung.pid, signal.SIGSTOP)
        with pytest.raises(FrontEndError, match="gave no reply in 0.5 s"):
            front._worker.call(_Request("hear", front._stream, np.zeros(480, np.float32).tobytes()), timeout=0.5)
        hung.join(10)
        assert not hung.is_alive()
        again = pool.open(RATE, VADConfig(use_silero=False))
        assert len(again.hear(np.zeros(960, np.int16).tobytes())[0]) > 0 and pool.processes[0] is not hung
    finally:
        pool.close()
