"""The shared TTS worker: a pool of threads, each with its own loaded voice, serving every session.

A reply's first piece goes before later pieces of other replies: the first audio of a turn is
latency-critical, the rest only has to stay ahead of playback (``first_pieces_first=False``: plain
arrival order, for comparison). The pool has one queue in that order; whichever thread is free
takes the next piece and synthesizes it with an idle voice instance (as many instances as
threads, so one is always idle), so N replies are synthesized side by side. ``stream()`` hands
the chunks to asyncio code as they are synthesized and stops when the piece's ``CancelToken`` is
cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from speech.cancel import CancelToken
from speech.config import TTSConfig
from speech.messages import AudioChunk
from speech.priority_worker import PriorityWorker, arrival_order
from speech.tts.base import TTSBackend
from speech.tts.factory import load_tts

log = logging.getLogger(__name__)

# A voice instance's first synthesis is slow (about a second for hibari); its made-up word also loads
# hibari's out-of-vocabulary net, which the first answer with an unknown word (a name, a code, a
# random model's noise) would otherwise load: on the 2-core CPU that answer took 85 ms instead of 38.
WARM_UP_TEXT = "Warm up, Qwzyx."


@dataclass(frozen=True)
class TTSJob:
    """One piece of a reply to synthesize; ``deliver`` takes each (chunk, ready time), then the end."""

    text: str
    cancel: CancelToken
    first: bool  # the first piece of its reply
    deliver: Callable[[object], None]


def first_piece_first(job: TTSJob) -> int:
    """The TTS queue's ordering key: a reply's first piece (0) before later pieces (1)."""
    return 0 if job.first else 1


_DONE = object()


class TTSWorker(PriorityWorker[TTSJob]):
    """One thread per voice instance in ``backends``, every session's pieces: first pieces first,
    or in arrival order."""

    join_timeout_s = 30.0

    def __init__(self, backends: list[TTSBackend], first_pieces_first: bool = True) -> None:
        if not backends:
            raise ValueError("the TTS worker needs at least one voice instance")
        self.backends = tuple(backends)
        self.sample_rate = backends[0].sample_rate
        self._idle: queue.SimpleQueue[TTSBackend] = queue.SimpleQueue()
        for backend in backends:
            self._idle.put(backend)
        super().__init__("tts-worker", key=first_piece_first if first_pieces_first else arrival_order, threads=len(backends))

    @classmethod
    def from_config(cls, config: TTSConfig, first_pieces_first: bool = True) -> TTSWorker:
        """``config.workers`` instances of the configured voice, loaded and warmed up side by side."""

        def warm(_: int) -> TTSBackend:
            backend = load_tts(config)
            backend.synthesize(WARM_UP_TEXT)
            return backend

        with ThreadPoolExecutor(config.workers, thread_name_prefix="tts-load") as pool:
            return cls(list(pool.map(warm, range(config.workers))), first_pieces_first)

    async def stream(self, text: str, cancel: CancelToken, first: bool) -> AsyncIterator[tuple[AudioChunk, float]]:
        """The audio of ``text`` as (chunk, perf_counter when it was ready); stops when cancelled."""
        loop = asyncio.get_running_loop()
        queue_: asyncio.Queue[object] = asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue_.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        self.submit(TTSJob(text, cancel, first, deliver))
        while (item := await queue_.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]

    def close(self) -> None:
        """As :meth:`PriorityWorker.close`, then close the voice instances."""
        super().close()
        for backend in self.backends:
            backend.close()

    def _closed_error(self) -> Exception:
        return RuntimeError("the TTS worker is closed")

    def _process(self, job: TTSJob) -> None:
        backend = self._idle.get()  # never waits: there are as many instances as threads
        try:
            for chunk in backend.stream(job.text, job.cancel):
                job.deliver((chunk, time.perf_counter()))
            job.deliver(_DONE)
        except Exception as exc:  # delivered to the reply; the worker keeps serving
            log.exception("TTS failed")
            job.deliver(exc)
        finally:
            self._idle.put(backend)


__all__ = ["TTSJob", "TTSWorker", "first_piece_first"]
