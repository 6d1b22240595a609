"""The shared TTS worker: one thread owns the loaded TTS backend and serves every session.

A reply's first piece goes before later pieces of other replies: the first audio of a turn is
latency-critical, the rest only has to stay ahead of playback (``first_pieces_first=False``: plain
arrival order, for comparison). ``stream()`` hands the chunks to
asyncio code as they are synthesized and stops when the piece's ``CancelToken`` is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from speech.cancel import CancelToken
from speech.messages import AudioChunk
from speech.priority_worker import PriorityWorker, arrival_order
from speech.tts.base import TTSBackend

log = logging.getLogger(__name__)


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
    """One thread, one TTS backend, every session's pieces: first pieces first, or in arrival order."""

    join_timeout_s = 30.0

    def __init__(self, backend: TTSBackend, first_pieces_first: bool = True) -> None:
        self.backend = backend
        self.sample_rate = backend.sample_rate
        super().__init__("tts-worker", key=first_piece_first if first_pieces_first else arrival_order)

    async def stream(self, text: str, cancel: CancelToken, first: bool) -> AsyncIterator[tuple[AudioChunk, float]]:
        """The audio of ``text`` as (chunk, perf_counter when it was ready); stops when cancelled."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        self.submit(TTSJob(text, cancel, first, deliver))
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]

    def _closed_error(self) -> Exception:
        return RuntimeError("the TTS worker is closed")

    def _process(self, job: TTSJob) -> None:
        try:
            for chunk in self.backend.stream(job.text, job.cancel):
                job.deliver((chunk, time.perf_counter()))
            job.deliver(_DONE)
        except Exception as exc:  # delivered to the reply; the worker keeps serving
            log.exception("TTS failed")
            job.deliver(exc)


__all__ = ["TTSJob", "TTSWorker", "first_piece_first"]
