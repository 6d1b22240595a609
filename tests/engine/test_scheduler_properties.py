"""Property test: random arrivals, lengths, priorities and aborts never leak blocks or starve."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.helpers import SimulatedEngine, make_request

event = st.tuples(
    st.integers(0, 3),  # steps to run before this event
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max tokens
    st.sampled_from([0, 1, 5]),  # priority
    st.booleans(),  # abort it later
    st.integers(0, 50),  # prompt start token (shared prefixes when equal)
)


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(event, min_size=1, max_size=25),
    num_blocks=st.integers(12, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
    chunked=st.booleans(),
    prefix=st.booleans(),
    beside=st.sampled_from([0, 1, 8]),  # beside decodes: one prefill chunk of at most this many tokens (0: off)
)
def test_no_leaks_no_negative_refs_no_starvation(events, num_blocks, block_size, max_num_seqs, budget, chunked, prefix, beside):
    eng = SimulatedEngine(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked, prefix=prefix, beside_decodes_max_chunk=beside,
    )
    capacity = (num_blocks - 1) * block_size
    to_abort = []
    added = []
    for i, (wait, plen, max_tokens, prio, abort, start) in enumerate(events):
        for _ in range(wait):
            eng.step()
        plen = min(plen, capacity - 1)  # the engine rejects prompts the pool cannot hold
        req = eng.add(make_request(f"r{i}", plen, max_tokens=max_tokens, priority=prio, start_token=start))
        added.append(req)
        if abort:
            to_abort.append(req)
        if to_abort and i % 3 == 0:
            victim = to_abort.pop(0)
            if not victim.status.finished:
                eng.abort(victim)
    eng.run(max_steps=5_000)
    eng.assert_idle_and_clean()
    assert all(r.status.finished for r in added)
    for r in added:
        if r.status.value == "length":  # reached max_tokens, or alone filled the whole pool
            assert len(r.output_token_ids) == r.sampling_params.max_tokens or r.num_tokens >= capacity - block_size
