"""One thread that owns a model and serves queued jobs, most urgent first.

The ASR worker (finals before partials) and the TTS worker (a reply's first piece before later
pieces) are both this shape: a daemon thread, a condition, a closed flag and a priority queue.
The ordering rule is a key: the job with the smallest ``key(job)`` (an int or a tuple, taken
when the job is queued, with the lock held) goes next, ties in arrival order. After ``close()`` new jobs are refused; the jobs already queued are still processed, then
the thread ends.
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
    """A thread serving jobs by ``key(job)`` (smallest first), then arrival order.

    Subclasses say how a job is done (:meth:`_process`, on the worker thread) and may refine
    admission (:meth:`_admit`) and closing (:meth:`_on_close`); both run with the lock held and
    may use :meth:`_push`, :meth:`_queued`, :meth:`_remove` and :meth:`_replace` on the queue.
    """

    join_timeout_s: float | None = None  # how long close() waits for the thread (None: until it ends)

    def __init__(self, name: str, key: Callable[[Job], Any]) -> None:
        self.name = name
        self._key = key
        self._cond = threading.Condition()
        self._queue: list[_Entry[Job]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
        """Refuse new jobs, finish the queued ones, then end the thread (waits for it)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._on_close()
            self._cond.notify()
        self._thread.join(timeout=self.join_timeout_s)

    # ---- for subclasses (call the queue helpers with the lock held) -------------------------------
    @abstractmethod
    def _process(self, job: Job) -> None:
        """Do one job on the worker thread."""

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
    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            return heapq.heappop(self._queue).job if self._queue else None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            self._process(job)


__all__ = ["PriorityWorker", "arrival_order"]
