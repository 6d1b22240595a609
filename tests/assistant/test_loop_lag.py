"""The event-loop lag monitor: a blocked loop shows up in its histogram, a free one does not."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from assistant.bench import lag_quantiles
from assistant.loop_lag import LoopLag


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_a_loop_blocked_for_150_ms_is_seen_as_one_late_timer() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval_s=0.01)

    async def run() -> None:
        lag.ensure_running()
        lag.ensure_running()  # once per loop, however often asked
        await asyncio.sleep(0.1)
        time.sleep(0.15)  # what a blocking call on the loop does to every session
        await asyncio.sleep(0.1)
        await lag.stop()

    asyncio.run(run())
    count = sample(registry, "assistant_event_loop_lag_seconds_count")
    assert count >= 10  # about one observation per 10 ms of free loop
    late = count - sample(registry, "assistant_event_loop_lag_seconds_bucket", le="0.1")
    assert late == 1, "exactly the timer that spanned the block woke more than 100 ms late"
    assert sample(registry, "assistant_event_loop_lag_seconds_sum") >= 0.14


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(CollectorRegistry(), interval_s=0)


def test_lag_quantiles_are_taken_between_two_scrapes() -> None:
    inf = float("inf")
    before = {0.001: 100.0, 0.01: 100.0, 0.1: 100.0, inf: 100.0}  # an idle loop before the phase
    after = {0.001: 150.0, 0.01: 195.0, 0.1: 199.0, inf: 200.0}  # 100 more: 50 <= 1 ms, 45 <= 10, 4 <= 100, 1 above
    assert lag_quantiles(before, after) == {"p50": 1.0, "p95": 10.0, "p99": 100.0, "n": 100.0}
    assert lag_quantiles(after, {**after, inf: 300.0}) == {"p50": None, "p95": None, "p99": None, "n": 100.0}
    assert lag_quantiles(after, after) is None and lag_quantiles({}, {}) is None
