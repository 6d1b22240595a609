"""A batching ASR backend gets up to ``max_batch`` queued jobs a turn, in the worker's order:
finals before partials, then the session served least recently. The backend here only records
the batches it is given (the real batched decode is tested in test_torch_whisper.py)."""

from __future__ import annotations

import threading

import numpy as np

from speech.asr.backend import ASRBackend, Decoded
from speech.asr.worker import ASRJob, ASRWorker


class RecordingBatchBackend(ASRBackend):
    """Takes up to three clips a call; holds the first call until ``gate`` is set."""

    supported_languages = ("en",)
    max_batch = 3

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def transcribe(self, audio, prefix="", language=None) -> Decoded:
        return self.transcribe_batch([(audio, prefix, language)])[0]

    def transcribe_batch(self, clips) -> list[Decoded]:
        self.started.set()
        assert self.gate.wait(60)
        self.batches.append([prefix for _, prefix, _ in clips])  # the prefix names the job here
        return [Decoded(prefix, "en") for _, prefix, _ in clips]


def test_batches_take_finals_first_and_respect_max_batch() -> None:
    backend = RecordingBatchBackend()
    done = threading.Event()
    results: list[tuple[str, str]] = []
    with ASRWorker(backend, queue_size=8) as worker:
        sessions = {name: worker.new_session_id() for name in "ABCDE"}

        def submit(name: str, final: bool) -> None:
            label = f"{name}{'F' if final else 'p'}"

            def on_done(job: ASRJob, result, queue_s: float, decode_s: float) -> None:
                results.append((label, result.text))
                if len(results) == 6:
                    done.set()

            worker.submit(ASRJob(sessions[name], 0, final, np.zeros(160, np.float32), label, "en", 0.01, on_done))

        submit("A", False)  # taken alone and held: the rest queue behind it
        assert backend.started.wait(60)
        for name, final in (("B", False), ("D", False), ("C", True), ("A", False), ("E", True)):
            submit(name, final)
        backend.gate.set()
        assert done.wait(60)
        stats = worker.stats
    assert backend.batches == [["Ap"], ["CF", "EF", "Bp"], ["Dp", "Ap"]]
    assert all(label == text for label, text in results)  # each job got its own result
    assert (stats.batches, stats.largest_batch, stats.processed_finals, stats.processed_partials) == (3, 3, 2, 4)


def test_a_backend_without_batching_is_served_one_job_at_a_time(whisper_tiny) -> None:
    assert whisper_tiny.max_batch == 1
    with ASRWorker(whisper_tiny) as worker:
        assert worker.batch_limit == 1
