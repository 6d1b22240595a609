"""The shared Silero scorer: callers fed from their own threads get exactly what a model of their own gives."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import pytest

from speech.audio import resample
from speech.config import VADConfig
from speech.silero_batch import SileroScorer, SileroStream
from speech.vad import SileroVAD, VoiceActivityDetector

STREAMS = 6
TIMEOUT_S = 60


def packets(audio: np.ndarray, seed: int) -> list[np.ndarray]:
    """The audio cut into random packet sizes (1 to 2000 samples), different for every seed."""
    rng, out, i = np.random.default_rng(seed), [], 0
    while i < len(audio):
        n = int(rng.integers(1, 2000))
        out.append(audio[i : i + n])
        i += n
    return out


def in_threads(work: Callable[[int], object], n: int) -> list:
    """``work(i)`` for i < n, each on a thread of its own, started together; results or exceptions."""
    results: list = [TimeoutError("thread did not finish")] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a caller hung"
    return results


@pytest.fixture(scope="module")
def clips16k(question_clips) -> list[np.ndarray]:
    return [resample(clip.audio, clip.sample_rate, 16000) for clip in question_clips[:STREAMS]]


def alone(audio: np.ndarray) -> np.ndarray:
    """The old path: a Silero session of the stream's own, batch 1."""
    return SileroVAD().process(audio)


def feed(stream: SileroStream, audio: np.ndarray, seed: int) -> np.ndarray:
    return np.concatenate([stream.process(p) for p in packets(audio, seed)])


def test_concurrent_streams_get_the_probabilities_of_a_model_of_their_own(clips16k) -> None:
    scorer = SileroScorer(wait_ms=2.0)
    streams = [scorer.stream() for _ in clips16k]
    probs = in_threads(lambda i: feed(streams[i], clips16k[i], seed=i), STREAMS)
    for audio, got in zip(clips16k, probs):
        expected = alone(audio)
        assert len(got) == len(expected) == len(audio) // SileroVAD.WINDOW
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert expected.max() > 0.9 and expected.min() < 0.1  # speech and silence were both heard
    stats = scorer.stats
    assert stats.windows == sum(len(audio) // SileroVAD.WINDOW for audio in clips16k)
    assert stats.largest_batch > 1 and stats.calls < stats.windows  # callers did share calls


def test_vad_events_do_not_change_with_the_shared_scorer(clips16k) -> None:
    config = VADConfig(pause_ms=200)
    scorer = SileroScorer(wait_ms=1.0)

    def events(i: int) -> list:
        vad = VoiceActivityDetector(config, scorer)
        found = [event for p in packets(clips16k[i], seed=100 + i) for event in vad.process(p)]
        vad.close()
        return found

    shared = in_threads(events, STREAMS)
    for audio, got in zip(clips16k, shared):
        expected = VoiceActivityDetector(config).process(audio)
        assert got == expected and len(expected) >= 2
    assert scorer.stats.largest_batch > 1


def test_a_stream_reset_or_closed_midway_leaves_the_others_alone(clips16k) -> None:
    scorer = SileroScorer(wait_ms=2.0)
    streams = [scorer.stream() for _ in clips16k]
    half = len(clips16k[0]) // 2

    def work(i: int) -> np.ndarray | None:
        stream, audio = streams[i], clips16k[i]
        if i == 0:  # resets halfway, then starts its audio over
            feed(stream, audio[:half], seed=i)
            stream.reset()
        elif i == 1:  # leaves halfway
            feed(stream, audio[:half], seed=i)
            stream.close()
            return None
        return feed(stream, audio, seed=i)

    probs = in_threads(work, STREAMS)
    assert probs[1] is None
    for i in (0, *range(2, STREAMS)):
        np.testing.assert_allclose(probs[i], alone(clips16k[i]), atol=1e-5)


def test_a_batch_never_waits_for_streams_that_left() -> None:
    """With a wait far past the test's timeout, a batch can only finish if closed (or dropped)
    streams no longer count as open."""
    scorer = SileroScorer(wait_ms=600_000)
    staying, closed, dropped = scorer.stream(), scorer.stream(), scorer.stream()
    closed.close()
    del dropped
    gc.collect()
    for stream in (staying, closed):  # a closed stream may still be fed (a caller winding down)
        [probs] = in_threads(lambda i, stream=stream: stream.process(np.zeros(16000, np.float32)), 1)
        assert isinstance(probs, np.ndarray) and len(probs) == 16000 // SileroVAD.WINDOW


def test_an_error_in_the_batched_call_raises_in_every_caller_of_the_batch(clips16k) -> None:
    scorer = SileroScorer(wait_ms=600_000)  # the call waits for all streams: one batch, every caller in it
    streams = [scorer.stream() for _ in range(3)]
    streams[0]._h = np.zeros((1, 1, 128), np.float64)  # a state ONNX Runtime refuses (double, not float)
    results = in_threads(lambda i: streams[i].process(clips16k[i][:16000]), 3)
    assert all(isinstance(r, Exception) and "double" in str(r) for r in results), results
    assert scorer.stats.calls == 1
    streams[0].reset()  # the scorer serves on
    results = in_threads(lambda i: streams[i].process(clips16k[i][:16000]), 3)
    for audio, got in zip(clips16k, results):
        np.testing.assert_allclose(got, alone(audio[:16000]), atol=1e-5)
