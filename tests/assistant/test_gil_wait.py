"""The GIL wait probe: a thread that keeps the GIL makes the probe wait, a free GIL does not."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from assistant.gil_wait import GilWait


def observed(registry: CollectorRegistry) -> tuple[float, float]:
    """(observations, of which more than 20 ms late)."""
    count = registry.get_sample_value("assistant_gil_wait_seconds_count") or 0.0
    fast = registry.get_sample_value("assistant_gil_wait_seconds_bucket", {"le": "0.02"}) or 0.0
    return count, count - fast


def test_a_thread_holding_the_gil_makes_the_probe_wait_a_switch_interval() -> None:
    """A pure-Python busy thread holds the GIL until the switch interval (here 50 ms) forces it to
    hand it over: the probe's wake-ups come that late. Without it they do not."""
    registry = CollectorRegistry()
    probe = GilWait(registry, interval_s=0.005)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        probe.ensure_running()
        probe.ensure_running()  # one thread, however often asked
        time.sleep(0.3)
        free_count, free_late = observed(registry)
        stop = threading.Event()

        def hog() -> None:
            while not stop.is_set():
                sum(range(1000))  # Python bytecode: keeps the GIL between forced switches

        busy = threading.Thread(target=hog)
        busy.start()
        time.sleep(1.0)
        stop.set()
        busy.join()
        count, late = observed(registry)
    finally:
        probe.stop()
        sys.setswitchinterval(previous)
    assert free_count >= 10 and free_late <= 1  # a free GIL: wake-ups on time
    assert count - free_count >= 5 and (late - free_late) >= 0.5 * (count - free_count)  # most waited > 20 ms
    assert threading.active_count() < 50 and not any(t.name == "gil-wait" for t in threading.enumerate())
    with pytest.raises(ValueError, match="interval_s"):
        GilWait(CollectorRegistry(), interval_s=0)
