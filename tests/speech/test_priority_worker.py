"""The priority-worker base: key order then arrival order, close wakes the thread, refuses new work."""

from __future__ import annotations

import threading

import pytest

from speech.priority_worker import PriorityWorker


class Recorder(PriorityWorker[tuple[int, str]]):
    """Jobs are (key, name); the first job it takes waits for ``release`` so others can queue."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.busy = threading.Event()
        self.release = threading.Event()
        super().__init__("test-worker", key=lambda job: job[0])

    def _process(self, job: tuple[int, str]) -> None:
        self.busy.set()
        assert self.release.wait(10)
        self.done.append(job[1])


def test_smallest_key_first_then_arrival_order() -> None:
    worker = Recorder()
    worker.submit((5, "blocker"))
    assert worker.busy.wait(10)
    for job in [(1, "late-a"), (0, "urgent-a"), (1, "late-b"), (0, "urgent-b")]:
        assert worker.submit(job)
    worker.release.set()
    worker.close()
    assert worker.done == ["blocker", "urgent-a", "urgent-b", "late-a", "late-b"]


def test_close_wakes_the_idle_thread_and_finishes_queued_jobs() -> None:
    idle = Recorder()
    idle.close()  # the thread waits on the condition: close must wake it, or this hangs
    assert not any(t.is_alive() for t in idle._threads)

    busy = Recorder()
    busy.submit((0, "running"))
    assert busy.busy.wait(10)
    busy.submit((0, "queued"))
    closer = threading.Thread(target=busy.close)
    closer.start()
    busy.release.set()
    closer.join(10)
    assert not closer.is_alive() and not any(t.is_alive() for t in busy._threads)
    assert busy.done == ["running", "queued"]


def test_work_after_close_is_refused() -> None:
    worker = Recorder()
    worker.close()
    with pytest.raises(RuntimeError, match="test-worker is closed"):
        worker.submit((0, "too late"))


def test_admission_and_queue_edits_keep_the_order() -> None:
    class Deduplicating(Recorder):
        """One queued job per name: a newer one takes the older one's place; key 9 is turned away."""

        def _admit(self, job: tuple[int, str]) -> bool:
            if job[0] == 9:
                return False
            self._remove(lambda queued: queued[1] == "drop-me")
            if not self._replace(lambda queued: queued[1] == job[1], job):
                self._push(job)
            return True

    worker = Deduplicating()
    worker.submit((0, "blocker"))
    assert worker.busy.wait(10)
    assert worker.submit((1, "a")) and worker.submit((1, "drop-me")) and worker.submit((1, "b"))
    assert worker.submit((1, "a"))  # takes the queued "a"'s place: not queued twice
    assert not worker.submit((9, "refused"))
    worker.release.set()
    worker.close()
    assert worker.done == ["blocker", "a", "b"]
