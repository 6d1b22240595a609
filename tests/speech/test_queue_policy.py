"""The workers' queue policies as the co-scheduler sets them: urgent work first (finals before
partials, a reply's first piece before later pieces, partials only with spare capacity), or each
worker in plain arrival order.

A gated backend holds the first job so the others queue behind it: the order is the worker's own,
so no model is needed to see it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np

from speech.asr.worker import ASRJob, ASRQueuePolicy, ASRWorker
from speech.cancel import CancelToken
from speech.config import TTSConfig
from speech.tts.base import TTSBackend
from speech.tts.worker import TTSJob, TTSWorker
from tests.speech.test_asr_fairness import GatedBackend, run_order


def queue_partials_then_a_final(worker, job) -> None:
    worker.submit(job("A", False))
    worker.submit(job("B", False))
    worker.submit(job("C", True))


def test_urgent_first_decodes_the_final_before_earlier_partials() -> None:
    assert run_order(queue_partials_then_a_final, 3, ASRQueuePolicy(urgent_first=True)) == [
        ("C", True, 0), ("B", False, 0), ("A", False, 0),
    ]  # fmt: skip


def test_arrival_order_decodes_in_the_order_submitted() -> None:
    assert run_order(queue_partials_then_a_final, 3, ASRQueuePolicy(urgent_first=False)) == [
        ("A", False, 0), ("B", False, 0), ("C", True, 0),
    ]  # fmt: skip


def test_partials_wait_for_spare_capacity_and_finals_never_do() -> None:
    spare = [True]
    decoded: list[tuple[int, bool]] = []
    done = threading.Semaphore(0)

    def on_done(job: ASRJob, result, queue_s: float, decode_s: float) -> None:
        decoded.append((job.session, job.is_final))
        done.release()

    backend = GatedBackend()
    with ASRWorker(backend, policy=ASRQueuePolicy(spare_capacity=lambda: spare[0])) as worker:
        a, b, c = worker.new_session_id(), worker.new_session_id(), worker.new_session_id()

        def job(session: int, final: bool) -> ASRJob:
            return ASRJob(session, 0, final, np.zeros(1600, np.float32), "", "en", 0.1, on_done)

        assert worker.submit(job(a, True))  # holds the worker
        assert backend.started.wait(60)
        assert worker.submit(job(b, False))  # queued while there is spare capacity...
        spare[0] = False  # ...then a turn becomes urgent: it is skipped when its turn comes
        assert not worker.submit(job(a, False))  # turned away at once
        assert worker.submit(job(c, True))  # a final is always taken, and goes first
        backend.gate.set()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        deadline = time.monotonic() + 60
        while worker.stats.skipped_partials < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # b's partial reaches its turn after c's final, and is skipped
        stats = worker.stats
    assert decoded == [(a, True), (c, True)]
    assert stats.skipped_partials == 2 and stats.processed_partials == 0 and stats.processed_finals == 2


class GatedTTS(TTSBackend):
    """Holds its first piece until ``gate`` is set; every piece is a few samples of silence."""

    name = "gated"
    sample_rate = 16000

    def __init__(self) -> None:
        super().__init__(TTSConfig())
        self.started = threading.Event()
        self.gate = threading.Event()

    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        self.started.set()
        assert self.gate.wait(60)
        yield np.zeros(160, np.float32)


def tts_order(first_pieces_first: bool) -> list[str]:
    """The order pieces are synthesized in: one holds the worker, then a later piece of one reply
    and the first piece of another are queued, in that order."""
    order: list[str] = []
    finished = threading.Semaphore(0)
    backend = GatedTTS()

    def job(text: str, first: bool) -> TTSJob:
        def deliver(item: object) -> None:
            if not isinstance(item, tuple):  # the end of the piece
                order.append(text)
                finished.release()

        return TTSJob(text, CancelToken(), first, deliver)

    worker = TTSWorker([backend], first_pieces_first=first_pieces_first)
    try:
        worker.submit(job("holding", True))
        assert backend.started.wait(60)
        worker.submit(job("later piece", False))
        worker.submit(job("first piece", True))
        backend.gate.set()
        for _ in range(3):
            assert finished.acquire(timeout=60)
    finally:
        worker.close()
    return order[1:]


def test_tts_first_pieces_first_or_arrival_order() -> None:
    assert tts_order(first_pieces_first=True) == ["first piece", "later piece"]
    assert tts_order(first_pieces_first=False) == ["later piece", "first piece"]
