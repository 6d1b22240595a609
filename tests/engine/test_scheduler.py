"""The token-budget scheduler, driven by requests built directly (no model)."""

from __future__ import annotations

from tests.engine.helpers import SimulatedEngine, make_request


def chunks(out):
    return {c.request.request_id: c.num_tokens for c in out.chunks}


def test_decodes_first_then_prefill_chunks_share_the_step():
    eng = SimulatedEngine(num_blocks=200, block_size=4, max_num_batched_tokens=16)
    a = eng.add(make_request("a", 3, max_tokens=10))
    eng.step()  # a prefilled, first token out
    eng.add(make_request("long", 40, max_tokens=2))
    out = eng.step()
    assert chunks(out) == {"a": 1, "long": 15}  # a's decode + a 15-token chunk of the long prompt
    out = eng.step()
    assert chunks(out) == {"a": 1, "long": 15}
    out = eng.step()
    assert chunks(out) == {"a": 1, "long": 10}
    assert a.status.value == "running"


def test_chunk_sizes_follow_the_budget_and_threshold():
    eng = SimulatedEngine(num_blocks=200, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=7)
    eng.add(make_request("p", 20))
    sizes = [chunks(eng.step())["p"] for _ in range(3)]
    assert sizes == [7, 7, 6]


def test_without_chunking_a_long_prompt_runs_whole():
    eng = SimulatedEngine(num_blocks=200, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    eng.add(make_request("d", 2, max_tokens=10))
    eng.step()
    eng.add(make_request("long", 30))
    assert chunks(eng.step()) == {"d": 1, "long": 30}


def test_seat_cap_and_fcfs_within_a_class():
    eng = SimulatedEngine(num_blocks=200, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        eng.add(make_request(rid, 5, max_tokens=3))
    assert set(chunks(eng.step())) == {"a", "b"}
    eng.run()
    assert [r.request_id for r in eng.finished] == ["a", "b", "c"]
    eng.assert_idle_and_clean()


def test_high_priority_request_preempts_on_the_seat_cap_in_the_very_next_step():
    eng = SimulatedEngine(num_blocks=500, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    low = [eng.add(make_request(f"low{i}", 6, max_tokens=50, priority=5)) for i in range(4)]
    eng.step()
    eng.step()
    assert all(r.status.value == "running" for r in low)
    eng.add(make_request("voice", 10, max_tokens=3, priority=0, start_token=200))
    out = eng.step()  # the very next step
    assert chunks(out)["voice"] == 10  # scheduled and (fully prefilled) -> first token this step
    assert [r.request_id for r in out.preempted] == ["low3"]  # the latest low-priority arrival
    assert low[3].status.value == "preempted" and low[3].num_computed_tokens == 0
    eng.run()
    eng.assert_idle_and_clean()
    assert low[3].num_preemptions == 1


def test_high_priority_request_preempts_when_memory_is_full():
    eng = SimulatedEngine(num_blocks=9, block_size=4, max_num_seqs=10, max_num_batched_tokens=64)  # 8 usable blocks
    low = [eng.add(make_request(f"low{i}", 12, max_tokens=8, priority=5)) for i in range(2)]
    eng.step()  # 3 + 3 blocks
    eng.add(make_request("voice", 12, max_tokens=2, priority=0, start_token=300))
    out = eng.step()
    assert "voice" in chunks(out)
    assert out.preempted and out.preempted[0] is low[1]
    eng.run()
    eng.assert_idle_and_clean()


def test_equal_priority_does_not_preempt_running_work():
    eng = SimulatedEngine(num_blocks=500, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    eng.add(make_request("a", 5, max_tokens=5))
    eng.add(make_request("b", 5, max_tokens=5))
    eng.step()
    eng.add(make_request("c", 5, max_tokens=5))
    out = eng.step()
    assert "c" not in chunks(out) and not out.preempted


def test_running_request_out_of_memory_preempts_the_latest_arrival():
    eng = SimulatedEngine(num_blocks=7, block_size=2, max_num_seqs=8, max_num_batched_tokens=64, prefix=False)  # 6 usable
    a = eng.add(make_request("a", 4, max_tokens=8))
    b = eng.add(make_request("b", 4, max_tokens=8))
    eng.step()  # 2 + 2 blocks
    eng.step()  # both decode, need a 3rd block each at position 4: 6 blocks
    out = eng.step()  # still fits (positions 5)
    out = eng.step()  # position 6 needs a 4th block each: b is preempted for a
    assert b.status.value == "preempted" and a.status.value == "running"
    assert out.preempted == [b]
    eng.run()
    eng.assert_idle_and_clean()


def test_recompute_after_preemption_hits_the_prefix_cache():
    eng = SimulatedEngine(num_blocks=500, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    low = eng.add(make_request("low", 16, max_tokens=20, priority=5))
    eng.step()
    eng.step()
    eng.add(make_request("voice", 4, max_tokens=2, priority=0))
    eng.step()
    assert low.status.value == "preempted"
    eng.run()
    assert low.num_cached_tokens == 0  # its first admission missed
    assert eng.bm.prefix_cache.stats.hits >= 16  # the recompute found its blocks


def test_a_request_larger_than_the_whole_pool_is_stopped_not_livelocked():
    eng = SimulatedEngine(num_blocks=5, block_size=2, max_num_batched_tokens=64)  # 8 token slots
    r = eng.add(make_request("big", 4, max_tokens=20))
    eng.run(max_steps=50)
    assert r.status.value == "length" and len(r.output_token_ids) == 5  # positions 0..7 then out of room
    eng.assert_idle_and_clean()


BUCKETS = (512, 768, 1024, 1280, 1536, 2048)


def test_a_large_step_is_trimmed_to_a_graph_bucket_and_the_rest_runs_next_step():
    eng = SimulatedEngine(num_blocks=400, block_size=16, max_num_batched_tokens=2048, step_token_buckets=BUCKETS)
    reqs = [eng.add(make_request(f"r{i}", 500, max_tokens=3)) for i in range(3)]
    first = eng.step()
    assert first.num_batched_tokens == 1280  # 1,500 tokens would pad to 1,536: the last prompt gives up 220
    assert [c.num_tokens for c in first.chunks] == [500, 500, 280]
    assert reqs[2].num_computed_tokens == 280 and not reqs[2].output_token_ids
    second = eng.step()
    assert {c.request.request_id: c.num_tokens for c in second.chunks} == {"r0": 1, "r1": 1, "r2": 220}
    while eng.scheduler.has_work:
        eng.step()
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert eng.bm.num_free_blocks == eng.bm.num_usable_blocks


def test_small_steps_and_unchunked_steps_are_not_trimmed():
    small = SimulatedEngine(num_blocks=400, block_size=16, max_num_batched_tokens=2048, step_token_buckets=BUCKETS)
    for i in range(2):
        small.add(make_request(f"s{i}", 300))
    assert small.step().num_batched_tokens == 600  # weight-bound: padding to 768 is cheaper than a later first token
    whole = SimulatedEngine(num_blocks=400, block_size=16, max_num_batched_tokens=2048, step_token_buckets=BUCKETS,
                            enable_chunked_prefill=False)
    for i in range(3):
        whole.add(make_request(f"w{i}", 500))
    assert whole.step().num_batched_tokens == 1500  # without chunking a prompt runs whole


def test_the_token_budget_is_taken_and_given_back():
    from engine.scheduler import TokenBudget

    budget = TokenBudget(16)
    budget.take(10)
    budget.give_back(3)  # a preempted request's chunk returns its tokens
    budget.take(9)
    assert budget.remaining == 0


def test_beside_decodes_a_step_holds_one_prefill_chunk_of_a_graph_shape():
    """With beside_decodes_max_chunk (the start-up mixed-step graphs' largest chunk), a step that
    has decodes takes one prefill chunk of at most that many tokens, the most urgent first: a
    second question waits a step instead of making the step one no graph holds. With nothing
    decoding, prompts share a step as before."""
    eng = SimulatedEngine(num_blocks=200, block_size=4, max_num_batched_tokens=64, beside_decodes_max_chunk=8)
    eng.add(make_request("a", 5, max_tokens=20, start_token=100))
    eng.add(make_request("b", 5, max_tokens=20, start_token=200))
    assert chunks(eng.step()) == {"a": 5, "b": 5}  # nothing decodes yet: no limit
    eng.add(make_request("q1", 20, max_tokens=2, priority=5, start_token=300))
    eng.add(make_request("q2", 6, max_tokens=2, priority=5, start_token=400))
    eng.add(make_request("urgent", 12, max_tokens=2, priority=0, start_token=500))
    assert chunks(eng.step()) == {"a": 1, "b": 1, "urgent": 8}  # the urgent one first, capped at 8
    assert chunks(eng.step()) == {"a": 1, "b": 1, "urgent": 4}  # its rest; nobody else admitted beside it
    assert chunks(eng.step()) == {"a": 1, "b": 1, "urgent": 1, "q1": 8}  # then FCFS: q1, still capped
    assert chunks(eng.step()) == {"a": 1, "b": 1, "q1": 8}  # urgent is done (2 tokens); q2 waits behind q1
    assert chunks(eng.step()) == {"a": 1, "b": 1, "q1": 4}
    assert chunks(eng.step()) == {"a": 1, "b": 1, "q1": 1, "q2": 6}
    eng.run()
    eng.assert_idle_and_clean()
