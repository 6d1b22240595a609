"""The scheduler's step bound: while urgent work is on its way, background classes share a few
tokens a step, so the urgent request's first token does not wait behind long prefill chunks.

Time is simulated with a compute-bound cost model (a step takes as long as it has tokens), as a
long prefill on a GPU does; the scheduler and block manager are the real ones. Last, the
AsyncEngine built from a config hands the policy to its scheduler."""

from __future__ import annotations

import threading

import pytest

from engine import AsyncEngine, SamplingParams
from engine.llm import make_config
from engine.scheduler import StepBound
from tests.engine.helpers import SimulatedEngine, make_request

URGENT, BULK = -1, 0
BOUND = StepBound(priority=URGENT, tokens=256)


def chunks(out):
    return {c.request.request_id: c.num_tokens for c in out.chunks}


def first_token_wait(bounded: bool, asr_final_after: int = 1500) -> tuple[int, SimulatedEngine]:
    """A 16k-token bulk prompt is prefilling when a voice turn ends (mid-step); its transcript is
    ready ``asr_final_after`` time units later, and its request joins at the next step boundary.
    Returns the time from the turn's end to its first token."""
    urgent_waiting = [False]
    policy = (lambda: BOUND if urgent_waiting[0] else None) if bounded else None
    eng = SimulatedEngine(num_blocks=2100, block_size=16, step_bound=policy, max_num_batched_tokens=2048)
    eng.add(make_request("bulk", 16_000, max_tokens=2, priority=BULK))
    now = 0
    turn_end = 1024  # inside the first step
    voice = None
    while voice is None or not voice.output_token_ids:
        if voice is None and now >= turn_end + asr_final_after:
            voice = eng.add(make_request("voice", 100, max_tokens=3, priority=URGENT, start_token=500))
        out = eng.step()
        now += out.num_batched_tokens
        if now > turn_end:
            urgent_waiting[0] = True  # the co-scheduler's count: a turn waits for its final, then its first token
    eng.run()
    eng.assert_idle_and_clean()
    return now - turn_end, eng


def test_the_bound_brings_the_urgent_first_token_sooner():
    unbounded, _ = first_token_wait(bounded=False)
    bounded, eng = first_token_wait(bounded=True)
    assert unbounded == 5120  # the rest of step 1, a 2048-token step while the final decodes, then its own
    assert bounded <= 2000, bounded
    assert bounded * 2 < unbounded
    assert [r.request_id for r in eng.finished] == ["voice", "bulk"]  # the bulk request still finished


def test_the_urgent_class_keeps_the_whole_budget_and_the_rest_share_the_bound():
    eng = SimulatedEngine(num_blocks=500, block_size=16, step_bound=lambda: BOUND, max_num_batched_tokens=2048)
    eng.add(make_request("bulk", 4000, priority=BULK))
    eng.add(make_request("batch", 4000, priority=BULK + 1, start_token=300))
    eng.add(make_request("voice", 1000, priority=URGENT, start_token=600))
    assert chunks(eng.step()) == {"voice": 1000, "bulk": 256}  # "batch", behind it, gets nothing this step
    eng.run()
    eng.assert_idle_and_clean()


def test_without_a_bound_the_background_takes_what_is_left():
    eng = SimulatedEngine(num_blocks=500, block_size=16, step_bound=lambda: None, max_num_batched_tokens=2048)
    eng.add(make_request("bulk", 4000, priority=BULK))
    eng.add(make_request("voice", 1000, priority=URGENT, start_token=600))
    assert chunks(eng.step()) == {"voice": 1000, "bulk": 1048}


def test_a_bound_must_allow_a_token():
    with pytest.raises(ValueError, match="tokens=0"):
        StepBound(priority=0, tokens=0)


async def test_the_async_engine_hands_the_policy_to_its_scheduler_and_asks_it_on_its_thread(tiny_llama_dir):
    asked_on: list[str] = []

    def policy() -> StepBound | None:
        asked_on.append(threading.current_thread().name)
        return None

    engine = AsyncEngine(make_config(str(tiny_llama_dir), num_kv_blocks=64), step_bound=policy)
    try:
        deltas = [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert deltas[-1].finished
    finally:
        engine.shutdown()
    assert len(asked_on) >= 3 and set(asked_on) == {"engine-loop"}  # once a step
    with pytest.raises(ValueError, match="step_bound"):
        AsyncEngine(core=engine.core, step_bound=policy)  # a built core keeps its scheduler
