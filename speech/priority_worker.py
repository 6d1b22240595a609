"""Threads that own a model and serve queued jobs, most urgent first.

The ASR worker (finals before partials) and the TTS worker (a reply's first piece before later
pieces) are both this shape: daemon threads (one by default; the TTS worker runs one per voice
instance), a condition, a closed flag and one priority queue that every thread takes from.
The ordering rule is a key: the job with the smallest ``key(job)`` (an int or a tuple, taken
when the job is queued, with the lock held) goes next, ties in arrival order; a worker whose
``batch_limit`` is above 1 takes up to that many jobs a turn, in that order. After ``close()``
new jobs are refused; the jobs already queued are still processed, then the thread ends.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Job = TypeVar("Job")


@dataclass(order=True)
class _Entry(Generic[Job]):
    key: Any  # an int or a tuple of ints: whatever the worker's key returns
    seq: int
    job: Job = field(compare=False)


def arrival_order(job: object) -> int:
    """The key of a plain FIFO queue: every job the same, so arrival order decides."""
    return 0


class PriorityWorker(ABC, Generic[Job]):
    """``threads`` threads serving jobs by ``key(job)`` (smallest first), then arrival order.

    Subclasses say how a job is done (:meth:`_process`, on the worker thread) and may refine
    admission (:meth:`_admit`) and closing (:meth:`_on_close`); both run with the lock held and
    may use :meth:`_push`, :meth:`_queued`, :meth:`_remove` and :meth:`_replace` on the queue.
    """

    join_timeout_s: float | None = None  # how long close() waits for each thread (None: until it ends)
    batch_limit: int = 1  # jobs taken per turn of a thread (see _process_batch)

    def __init__(self, name: str, key: Callable[[Job], Any], threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"a worker needs at least one thread, got {threads}")
        self.name = name
        self._key = key
        self._cond = threading.Condition()
        self._queue: list[_Entry[Job]] = []
        self._seq = itertools.count()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=name if threads == 1 else f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when :meth:`_admit` turned it away. Raises once closed."""
        with self._cond:
            if self._closed:
                raise self._closed_error()
            accepted = self._admit(job)
            if accepted:
                self._cond.notify()
            return accepted

    def close(self) -> None:
        """Refuse new jobs, finish the queued ones, then end the threads (waits for each)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._on_close()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.join_timeout_s)

    # ---- for subclasses (call the queue helpers with the lock held) -------------------------------
    @abstractmethod
    def _process(self, job: Job) -> None:
        """Do one job on a worker thread (with several threads, several jobs run at once)."""

    def _process_batch(self, jobs: list[Job]) -> None:
        """Do the jobs taken in one turn, most urgent first (default: one after another)."""
        for job in jobs:
            self._process(job)

    def _admit(self, job: Job) -> bool:
        """Queue ``job`` (called with the lock held); False if it was turned away."""
        self._push(job)
        return True

    def _on_close(self) -> None:
        """Called once, with the lock held, when the worker closes (e.g. to drop queued jobs)."""

    def _closed_error(self) -> Exception:
        return RuntimeError(f"the {self.name} is closed")

    def _push(self, job: Job) -> None:
        """Queue ``job`` by its key, behind the queued jobs of the same key."""
        heapq.heappush(self._queue, _Entry(self._key(job), next(self._seq), job))

    def _queued(self) -> list[Job]:
        """The queued jobs, in no particular order."""
        return [entry.job for entry in self._queue]

    def _remove(self, match: Callable[[Job], bool]) -> int:
        """Drop the queued jobs that ``match``; returns how many."""
        kept = [entry for entry in self._queue if not match(entry.job)]
        removed = len(self._queue) - len(kept)
        if removed:
            heapq.heapify(kept)
            self._queue = kept
        return removed

    def _replace(self, match: Callable[[Job], bool], job: Job) -> bool:
        """Put ``job`` in the place of the first queued job that ``match`` (same key); False if none."""
        for entry in self._queue:
            if match(entry.job):
                entry.job = job
                return True
        return False

    # ---- the thread ----------------------------------------------------------------------------------
    def _next(self) -> list[Job]:
        """Up to ``batch_limit`` jobs, most urgent first; empty once closed and drained."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            count = min(self.batch_limit, len(self._queue))
            return [heapq.heappop(self._queue).job for _ in range(count)]

    def _run(self) -> None:
        while jobs := self._next():
            self._process_batch(jobs)


__all__ = ["PriorityWorker", "arrival_order"]
