"""The shared ASR worker: one thread, one loaded model, every session's decode requests.

The queue rules: finals go before partials and are never dropped; among finals, and among
partials, the session served least recently goes first (round robin: a session speaking on and
on, whose partials are re-decoded again and again, waits its turn behind the other sessions'
work; a session's own jobs keep their order); a session's queued partial is replaced by its newer
one (which keeps its place) or removed when its final is queued; a partial that finds
``queue_size`` partials queued is dropped; on close, queued partials are dropped and queued finals
still decoded. ``stats`` counts all of it.

A backend that batches (``max_batch`` above 1, e.g. the torch Whisper on a GPU) gets up to
``max_batch`` queued jobs a turn, taken in that same order (finals first, then partials, sessions
round robin), and decodes them as one batch; every job's ``decode_s`` is then the batch's time.
An :class:`ASRQueuePolicy`, given at construction, can turn the ordering off (arrival order, for
comparison) and make partials wait for spare capacity: a partial submitted, or reaching its turn,
while ``spare_capacity()`` says no is skipped (the session's next partial catches up).

The worker also owns its sessions' front ends (:meth:`ASRWorker.front_end`): in this process,
every session's Silero through one scorer (:meth:`ASRWorker.silero_scorer`) so that all callers'
windows are scored in one call; or, with ``front_end_processes``, in worker processes
(:class:`~speech.front_end.FrontEndPool`), off the GIL the engine and Whisper need.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speech.asr.backend import ASRBackend, ASRError, Decoded
from speech.asr.factory import load_backend
from speech.config import ASRConfig, ConfigError, VADConfig
from speech.front_end import FrontEnd, FrontEndPool, LocalFrontEnd
from speech.priority_worker import PriorityWorker, arrival_order
from speech.silero_batch import SileroScorer

log = logging.getLogger(__name__)

JobCallback = Callable[["ASRJob", "Decoded | Exception", float, float], None]


@dataclass
class ASRJob:
    """One decode request: a session's utterance audio so far (partial) or complete (final)."""

    session: int
    utterance: int
    is_final: bool
    audio: np.ndarray
    prefix: str
    language: str
    audio_end_s: float
    on_done: JobCallback  # (job, result or exception, queue_s, decode_s), on the worker thread
    submitted: float = field(default_factory=time.perf_counter)


def always() -> bool:
    """Spare capacity for every partial: the default of :attr:`ASRQueuePolicy.spare_capacity`."""
    return True


@dataclass(frozen=True)
class ASRQueuePolicy:
    """How the shared worker orders its queue and when it decodes partials.

    urgent_first: finals before partials, then the least recently served session (False: arrival
    order). spare_capacity: asked (with the worker's lock held: it must be quick and must not call
    the worker) when a partial is submitted and when its turn comes; False skips the partial.
    """

    urgent_first: bool = True
    spare_capacity: Callable[[], bool] = always


@dataclass(frozen=True)
class WorkerStats:
    """Counters of the shared worker, for tests and metrics."""

    queued_finals: int
    queued_partials: int
    max_queued_partials: int
    submitted_finals: int
    submitted_partials: int
    dropped_partials: int
    skipped_partials: int  # turned away or not decoded for want of spare capacity (ASRQueuePolicy)
    processed_finals: int
    processed_partials: int
    failed: int
    batches: int  # turns of the worker (a batch of one job counts)
    largest_batch: int


class ASRWorker(PriorityWorker[ASRJob]):
    """One thread, one model, many sessions (see the module docstring for the queue rules).

    ``submit(job)`` returns False when a partial was dropped because the queue was full or
    skipped for want of spare capacity;
    ``close()`` drops the queued partials, decodes the queued finals, then ends the thread.
    """

    def __init__(self, backend: ASRBackend, queue_size: int = 8, policy: ASRQueuePolicy = ASRQueuePolicy(),
                 front_end_processes: int = 0) -> None:  # fmt: skip
        if queue_size < 1:
            raise ConfigError(f"ASR worker queue_size={queue_size}: must be >= 1")
        if front_end_processes < 0:
            raise ConfigError(f"ASR worker front_end_processes={front_end_processes}: must be >= 0")
        self.backend = backend
        self.queue_size = queue_size
        self.policy = policy
        self._counts = dict.fromkeys(
            ("max_queued_partials", "submitted_finals", "submitted_partials", "dropped_partials", "skipped_partials",
             "processed_finals", "processed_partials", "failed", "batches", "largest_batch"),
            0,
        )  # fmt: skip
        self._session_ids = itertools.count()
        self._turns = itertools.count()
        self._last_turn: dict[int, int] = {}  # open session -> the turn it was last served in (-1: never)
        self.batch_limit = max(1, backend.max_batch)
        self._scorers: dict[tuple[Path | None, float], SileroScorer] = {}
        self._scorers_lock = threading.Lock()
        self._front_ends = FrontEndPool(front_end_processes) if front_end_processes else None
        super().__init__("asr-worker", key=self._finals_first_then_round_robin if policy.urgent_first else arrival_order)

    @classmethod
    def from_config(cls, config: ASRConfig, policy: ASRQueuePolicy = ASRQueuePolicy(),
                    gpu_lock: AbstractContextManager | None = None) -> ASRWorker:  # fmt: skip
        """Load the configured backend (``gpu_lock``: see :func:`~speech.asr.factory.load_backend`)
        and start a worker with the configured queue bound."""
        return cls(load_backend(config, gpu_lock), config.queue_size, policy, config.front_end_processes)

    def __enter__(self) -> ASRWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def front_end(self, input_rate: int, vad: VADConfig) -> FrontEnd:
        """A new session's resampler and VAD: in a front-end process when the worker has them,
        else here, Silero through the shared scorer."""
        if self._front_ends is not None:
            return self._front_ends.open(input_rate, vad)
        return LocalFrontEnd(input_rate, vad, self.silero_scorer(vad) if vad.use_silero else None)

    def close(self) -> None:
        """As :meth:`PriorityWorker.close`, then stop the front-end processes."""
        super().close()
        if self._front_ends is not None:
            self._front_ends.close()

    def silero_scorer(self, vad: VADConfig) -> SileroScorer:
        """The Silero scorer every session with this model and batch wait shares (loaded on first
        use), so one ONNX call scores all of the worker's sessions' windows."""
        key = (vad.silero_model, vad.silero_batch_wait_ms)
        with self._scorers_lock:
            if key not in self._scorers:
                self._scorers[key] = SileroScorer(vad.silero_model, vad.silero_batch_wait_ms)
            return self._scorers[key]

    def new_session_id(self) -> int:
        """A new session's id; its jobs take round-robin turns until :meth:`end_session`."""
        with self._cond:
            session = next(self._session_ids)
            self._last_turn[session] = -1
            return session

    def end_session(self, session: int) -> None:
        """Forget a closed session's turn (its jobs still queued are decoded as before)."""
        with self._cond:
            self._last_turn.pop(session, None)

    def _finals_first_then_round_robin(self, job: ASRJob) -> tuple[int, int]:
        """The queue's ordering key (lock held): finals (0) before partials (1), then the turn the
        job's session was last served in, so the least recently served session goes first; ties
        in arrival order. A session's later job never has an earlier turn than its queued ones."""
        return (0 if job.is_final else 1, self._last_turn.get(job.session, -1))

    @property
    def stats(self) -> WorkerStats:
        with self._cond:
            finals = sum(job.is_final for job in self._queued())
            return WorkerStats(
                queued_finals=finals,
                queued_partials=self._queued_partials(),
                **self._counts,
            )

    def _admit(self, job: ASRJob) -> bool:
        def session_partial(queued: ASRJob) -> bool:
            return not queued.is_final and queued.session == job.session

        if job.is_final:
            self._counts["submitted_finals"] += 1
            self._counts["dropped_partials"] += self._remove(session_partial)
            self._push(job)
            return True
        self._counts["submitted_partials"] += 1
        if self._skipped(job):
            return False
        if self._replace(session_partial, job):
            self._counts["dropped_partials"] += 1  # superseded, keeps its place
        elif self._queued_partials() >= self.queue_size:
            self._counts["dropped_partials"] += 1
            return False
        else:
            self._push(job)
        self._counts["max_queued_partials"] = max(self._counts["max_queued_partials"], self._queued_partials())
        return True

    def _skipped(self, job: ASRJob) -> bool:
        """A partial while the policy sees no spare capacity: counted, not to be decoded (lock held)."""
        if job.is_final or self.policy.spare_capacity():
            return False
        self._counts["skipped_partials"] += 1
        return True

    def _queued_partials(self) -> int:
        return sum(not job.is_final for job in self._queued())

    def _on_close(self) -> None:
        self._counts["dropped_partials"] += self._remove(lambda job: not job.is_final)

    def _closed_error(self) -> Exception:
        return ASRError("the ASR worker is closed")

    def _process(self, job: ASRJob) -> None:
        self._process_batch([job])

    def _process_batch(self, jobs: list[ASRJob]) -> None:
        with self._cond:
            jobs = [job for job in jobs if not self._skipped(job)]
            if not jobs:
                return
            for job in jobs:
                if job.session in self._last_turn:
                    self._last_turn[job.session] = next(self._turns)
        started = time.perf_counter()
        try:
            results: list[Decoded | Exception] = list(
                self.backend.transcribe_batch([(job.audio, job.prefix, job.language) for job in jobs])
            )
        except Exception as exc:  # delivered to the sessions; the worker keeps serving
            log.exception("ASR backend failed")
            results = [exc] * len(jobs)
        decode_s = time.perf_counter() - started
        with self._cond:
            self._counts["batches"] += 1
            self._counts["largest_batch"] = max(self._counts["largest_batch"], len(jobs))
            for job, result in zip(jobs, results):
                self._counts["processed_finals" if job.is_final else "processed_partials"] += 1
                self._counts["failed"] += isinstance(result, Exception)
        for job, result in zip(jobs, results):
            try:
                job.on_done(job, result, started - job.submitted, decode_s)
            except Exception:
                log.exception("ASR result callback failed")


__all__ = ["ASRJob", "ASRQueuePolicy", "ASRWorker", "JobCallback", "WorkerStats", "always"]
