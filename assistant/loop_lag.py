"""Event-loop lag: how late the server's event loop runs a timer, on ``/metrics``.

Every Realtime session's reading, sending and stage hand-offs run on one asyncio event loop, which
shares the process's GIL with the speech front end, the voice workers and the engine's thread.
When that loop falls behind, every stage looks slow at once (a transcript or a first token waits
to be handled), so the lag is measured directly: a task sleeps ``interval_s`` again and again and
records how much later than asked it woke (``assistant_event_loop_lag_seconds``). It starts with
the first Realtime session (:meth:`LoopLag.ensure_running`), on the loop that serves it.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class LoopLag:
    """A timer task on the serving loop and the histogram of its lateness."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.histogram = Histogram(
            "assistant_event_loop_lag_seconds",
            f"How much later than asked the serving event loop woke from a {interval_s * 1000:g} ms sleep "
            "(measured from the first Realtime session on).",
            buckets=LAG_BUCKETS, registry=registry,
        )  # fmt: skip
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start measuring on the running loop, unless already measuring there."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        """Stop measuring (the histogram keeps what it has)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.perf_counter() - asked - self.interval_s))


__all__ = ["LAG_BUCKETS", "LoopLag"]
