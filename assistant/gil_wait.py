"""GIL wait: how long a thread that wakes up waits for the GIL, on ``/metrics``.

The engine's loop and Whisper's worker release the GIL for every CUDA call and must take it back
before their next one; when other threads of the process keep it busy, each call can wait up to a
switch interval, and the GPU stages slow down while the GPU idles (on the H200 at 32 callers, a
Whisper batch took 540 ms instead of about 70). The event-loop lag (``assistant/loop_lag.py``)
shows this only for the loop. Here a thread of its own sleeps ``interval_s`` again and again
(the sleep releases the GIL, as a CUDA call does) and records how much later than asked it runs
Python again (``assistant_gil_wait_seconds``): the operating system's wake-up (tens of
microseconds) plus the wait for the GIL. It starts with the first Realtime session.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Histogram

WAIT_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class GilWait:
    """A probe thread and the histogram of its lateness."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.005) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.histogram = Histogram(
            "assistant_gil_wait_seconds",
            f"How much later than asked a probe thread ran Python again after a {interval_s * 1000:g} ms sleep: "
            "the wait for the GIL that every thread of the server shares (from the first Realtime session on).",
            buckets=WAIT_BUCKETS, registry=registry,
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure_running(self) -> None:
        """Start the probe thread, unless it runs."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="gil-wait", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stop the probe (the histogram keeps what it has)."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.perf_counter()
            time.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.perf_counter() - asked - self.interval_s))


__all__ = ["GilWait", "WAIT_BUCKETS"]
