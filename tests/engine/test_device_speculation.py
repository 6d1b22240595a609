"""Device speculation (engine/device_speculation.py): n-gram drafts, verification and the next
step's inputs decided on the device, each step launched before the one before it is read. The
real SmolLM2 on the CPU, where each step runs eagerly (on CUDA the same step is a graph): the
plain engine's greedy tokens, fewer steps, and the ways out of it (a request arriving, an abort,
sampling it cannot do) losing nothing and leaving no KV block behind. Stops: test_speculative.py's
stop test runs with it too."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from tests.engine.helpers import generate_staggered


def device_llm(smollm, llm_gguf_path, **kw) -> LLM:
    return LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, speculative="ngram", speculative_device="on", **kw)


@pytest.fixture(scope="module")
def plain(smollm, llm_gguf_path, quoting_prompts):
    """The plain engine's greedy answers (40 tokens at most), each prompt alone."""
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return [llm.generate([p], params)[0] for p in quoting_prompts]


def count_launches(llm) -> list[int]:
    """Each device step's number of requests, as launched (``llm``: an LLM or an EngineCore)."""
    spec = getattr(llm, "core", llm).device_speculation
    launches: list[int] = []
    launch = spec.launch

    def spy(requests):
        launches.append(len(requests))
        return launch(requests)

    spec.launch = spy
    return launches


def test_greedy_answers_are_the_plain_engines_in_fewer_steps(smollm, llm_gguf_path, quoting_prompts, plain):
    """Each prompt alone (bucket 1) and the three together (bucket 4, one padding request): the
    plain engine's tokens and text, drafts accepted, fewer device steps than tokens, and every
    KV block back in the pool."""
    llm = device_llm(smollm, llm_gguf_path)
    launches = count_launches(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for p, want in zip(quoting_prompts, plain):
        got = llm.generate([p], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert llm.core.spec_stats.num_accepted_tokens > 10
    assert 0 < len(launches) < sum(len(w.token_ids) for w in plain) - len(plain)
    launches.clear()
    together = llm.generate(quoting_prompts, params)
    assert [o.token_ids for o in together] == [w.token_ids for w in plain]
    assert 3 in launches
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_with_async_scheduling_it_enters_on_the_samples_in_flight(smollm, llm_gguf_path, quoting_prompts, plain):
    """With async scheduling (the GPU's default) a prompt's last step is still in flight when
    device speculation enters: it takes that step's samples on the device, and the host reads
    the step while the first device step runs behind it (no read back first). The answers are
    the plain engine's, alone and together, also of one and two tokens (the token in flight
    ends the request while a device step runs), and every KV block comes back."""
    llm = device_llm(smollm, llm_gguf_path, async_scheduling="on")
    spec = llm.core.device_speculation
    entered: list[bool] = []  # each entry: on the samples in flight
    enter = spec.enter

    def spy(requests, last=None):
        entered.append(last is not None)
        return enter(requests, last)

    spec.enter = spy
    params = SamplingParams(temperature=0.0, max_tokens=40)
    first_entries = []  # each generate's first entry (later ones follow a rest: nothing is in flight then)
    for p, want in zip(quoting_prompts, plain):
        assert llm.generate([p], params)[0].token_ids == want.token_ids
        first_entries.append(entered[0])
        entered.clear()
    assert [o.token_ids for o in llm.generate(quoting_prompts, params)] == [w.token_ids for w in plain]
    first_entries.append(entered[0])
    for n in (1, 2):
        assert llm.generate(quoting_prompts[:1], SamplingParams(temperature=0.0, max_tokens=n))[0].token_ids == plain[0].token_ids[:n]
    assert first_entries == [True] * 4
    stats = llm.core.device_stats
    assert stats.entries_ahead >= 6 and stats.entries >= stats.entries_ahead  # the two short answers entered too
    assert llm.core.spec_stats.num_accepted_tokens > 10
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_every_row_writes_into_its_requests_own_blocks(smollm, llm_gguf_path, quoting_prompts):
    """Each step's rows are laid out by the step before it (its slots come from the device's block
    tables then), while the host learns tokens a step late: the blocks of the step after next must
    be in the tables already. At every launch of long answers that repeat their prompt (drafts
    stand, so the device runs far ahead of the host), each real row's slot is its position's slot
    in its request's blocks (a slot dropped when its request finished writes only the null
    block), and the answers are the plain engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    want = [LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate([p], params)[0].token_ids for p in quoting_prompts[:2]]
    llm = device_llm(smollm, llm_gguf_path)
    spec = llm.core.device_speculation
    launch, checked = spec.launch, []

    def check(requests):
        page, rows = spec.page, spec.k + 1
        for slot, req in enumerate(requests):
            if req is None:
                assert all(int(spec.slots[row]) < page for row in range(slot * rows, (slot + 1) * rows)), "a dropped slot's row"
                continue
            for row in range(slot * rows, (slot + 1) * rows):
                pos = int(spec.positions[row])
                assert pos // page < len(req.block_ids), f"row {row} at position {pos}: its block is not the request's yet"
                assert int(spec.slots[row]) == req.block_ids[pos // page] * page + pos % page, f"row {row} at position {pos}"
        checked.append(len(requests))
        return launch(requests)

    spec.launch = check
    got = llm.generate(quoting_prompts[:2], params)
    assert [o.token_ids for o in got] == want
    assert len(checked) > 10 and llm.core.spec_stats.num_accepted_tokens > 40
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_a_request_finishing_first_leaves_the_other_on_the_device(smollm, llm_gguf_path, quoting_prompts, plain):
    """Two answers together, the first cut at 10 tokens: when it finishes, its slot becomes
    padding and the other stays on the device (one entry, one drop, one leave at the end, no
    read back between), in the first slot and in the last. Each answer is the plain engine's."""
    for short in (0, 1):
        core = device_llm(smollm, llm_gguf_path).core
        reqs = [core.add_request(p, SamplingParams(temperature=0.0, max_tokens=10 if i == short else 40))
                for i, p in enumerate(quoting_prompts[:2])]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.request_id] += out.token_ids
        assert len(plain[short].token_ids) > 10
        assert [tokens[r.request_id] for r in reqs] == [w.token_ids[:10] if i == short else w.token_ids for i, w in enumerate(plain[:2])]
        stats = core.device_stats
        assert (stats.entries, stats.drops, stats.leaves_other) == (1, 1, 1), stats
        assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_a_request_arriving_mid_answer_is_served_and_changes_nothing(smollm, llm_gguf_path, quoting_prompts, plain):
    """A prompt arriving while another decodes on the device: the device step in flight is read
    back, the newcomer prefills the host's way, then both go on on the device; each answer is
    the one it gets alone."""
    llm = device_llm(smollm, llm_gguf_path)
    launches = count_launches(llm)
    got = generate_staggered(llm.core, quoting_prompts[:2], SamplingParams(temperature=0.0, max_tokens=40), steps_between=6)
    assert got == [plain[0].token_ids, plain[1].token_ids]
    assert 1 in launches and 2 in launches
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_an_abort_mid_answer_leaves_the_other_request_untouched(smollm, llm_gguf_path, quoting_prompts):
    """Two requests decoding on the device, their tables grown since they entered; one is aborted
    mid-answer: the other goes on to the plain engine's answer, and every block comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate([p], params)[0].token_ids for p in quoting_prompts[::2]]
    core = device_llm(smollm, llm_gguf_path).core
    a, b = core.add_request(quoting_prompts[0], params), core.add_request(quoting_prompts[2], params)
    tokens: dict[str, list[int]] = {a.request_id: [], b.request_id: []}
    while len(tokens[a.request_id]) < 24:
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    assert core._device_inflight is not None  # mid-answer on the device
    spec = core.device_speculation
    for slot, req in enumerate(core._device_inflight[0].requests):  # the device's tables are the requests' blocks
        entered_with = core.block_manager.blocks_needed(len(req.prompt_token_ids) + 3 * (spec.k + 1))  # _device_allocate on entry
        assert len(req.block_ids) > entered_with  # grown since it entered
        for row in range(slot * (spec.k + 1), (slot + 1) * (spec.k + 1)):
            assert spec.row_tables[row, : len(req.block_ids)].tolist() == req.block_ids
    assert core.abort_request(a.request_id)
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    assert tokens[b.request_id] == want[1]
    assert tokens[a.request_id] == want[0][: len(tokens[a.request_id])]
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_by_default_device_speculation_stays_whatever_its_steps_yield(smollm, llm_gguf_path, quoting_prompts, plain):
    """Rows priced so high that no drafts could pay for them (a row costs 5 one-token steps), but
    rests off (the default): the request stays on the device to its end, in fewer steps than
    tokens, and the answer is the plain engine's."""
    llm = device_llm(smollm, llm_gguf_path, speculative_row_cost=5.0)
    launches = count_launches(llm)
    got = llm.generate(quoting_prompts[:1], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert got.token_ids == plain[0].token_ids
    assert 1 < len(launches) < len(got.token_ids) and not llm.core._device_resting
    assert (llm.core.device_stats.leaves_for_yield, llm.core.device_stats.entries) == (0, 1)
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_a_request_that_decoded_in_a_batch_too_large_to_speculate_never_enters(smollm, llm_gguf_path, quoting_prompts, plain):
    """Async scheduling, speculation up to 2 requests: three decode together, so none of them
    enters device speculation in the group's tail (as none drafts the host's way); a request
    alone afterwards does. Answers are the plain engine's."""
    llm = device_llm(smollm, llm_gguf_path, async_scheduling="on", speculative_max_batch=2)
    launches = count_launches(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    assert [o.token_ids for o in llm.generate(quoting_prompts, params)] == [w.token_ids for w in plain]
    assert launches == [] and llm.core.device_stats.entries == 0
    assert llm.generate(quoting_prompts[:1], params)[0].token_ids == plain[0].token_ids
    assert launches and llm.core.device_stats.entries == 1
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_steps_that_do_not_pay_send_the_requests_the_hosts_way(smollm, llm_gguf_path, quoting_prompts, plain):
    """With rests on, rows priced so high that no drafts can pay for them: the first device
    step's yield is below its cost, so the request leaves after it and rests (the host drafts
    nothing at that price); the answer is still the plain engine's. A new request gives device
    speculation a fresh chance."""
    llm = device_llm(smollm, llm_gguf_path, speculative_row_cost=5.0, speculative_device_rests=True)
    launches = count_launches(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for p, want in zip(quoting_prompts[:2], plain):
        assert llm.generate([p], params)[0].token_ids == want.token_ids
    assert launches == [1, 1]
    assert llm.core._device_resting
    assert (llm.core.device_stats.leaves_for_yield, llm.core.device_stats.entries) == (2, 2)
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_a_draft_standing_the_hosts_way_brings_the_requests_back(smollm, llm_gguf_path, quoting_prompts, plain):
    """With rests on, device speculation left for a poor yield (forced after its first step) rests
    while the host verifies; the host's first draft that stands ends the rest and the request goes
    back to the device; the answer is the plain engine's throughout."""
    core = device_llm(smollm, llm_gguf_path, speculative_device_rests=True).core
    spec = core.device_speculation
    entries: list[int] = []
    enter = spec.enter

    def spy(requests, last=None):
        entries.append(core.spec_stats.num_accepted_tokens)
        return enter(requests, last)

    spec.enter = spy
    req = core.add_request(quoting_prompts[0], SamplingParams(temperature=0.0, max_tokens=40))
    tokens: list[int] = []
    rested: list[bool] = []  # right after the leave
    while core.has_unfinished_requests():
        if len(entries) == 1 and core._device_inflight is not None:
            core._device_yield.mean = 0.0  # as after steps that gained nothing
        for out in core.step():
            tokens += out.token_ids
        if len(entries) == 1 and core._device_inflight is None and not rested:
            rested.append(core._device_resting)
    assert tokens == plain[0].token_ids
    assert rested == [True] and len(entries) >= 2 and req.status.finished
    assert core.device_stats.leaves_for_yield >= 1 and core.device_stats.entries == len(entries)
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_sampling_the_device_cannot_do_goes_the_hosts_way(smollm, llm_gguf_path, quoting_prompts):
    """Temperature 1, penalties and logprobs never take a device step, and still finish."""
    llm = device_llm(smollm, llm_gguf_path)
    launches = count_launches(llm)
    for params in (SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=3),
                   SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)):  # fmt: skip
        out = llm.generate(quoting_prompts[:1], params)[0]
        assert out.token_ids and out.finish_reason in ("stop", "length")
    assert launches == []
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_device_speculation_needs_ngram_speculation(smollm, llm_gguf_path):
    with pytest.raises(ConfigError, match="speculative_device='on' needs speculative='ngram'"):
        LLM(str(llm_gguf_path), loaded=smollm, speculative_device="on")


def test_auto_decides_ngram_speculation_on_cuda_devices_only(smollm, llm_gguf_path):
    """``speculative_device="auto"`` (the default): on with CUDA for n-gram speculation, never on
    the CPU (no device state is built there) nor for other kinds; "on" and "off" as said."""
    from engine.config import EngineConfig

    ngram = EngineConfig(model="m", speculative="ngram")
    assert ngram.speculative_device == "auto"
    assert ngram.device_speculation("cuda") and not ngram.device_speculation("cpu")
    assert EngineConfig(model="m", speculative="ngram", speculative_device="on").device_speculation("cpu")
    assert not EngineConfig(model="m", speculative="ngram", speculative_device="off").device_speculation("cuda")
    assert not EngineConfig(model="m").device_speculation("cuda")
    assert LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=64, speculative="ngram").core.device_speculation is None


async def test_a_client_going_away_mid_answer_on_the_device_frees_its_blocks(smollm, llm_gguf_path, quoting_prompts, plain):
    """Through the online engine: a greedy client stops reading while its request decodes on
    the device (its abort ends device speculation); another client's answer is the plain
    engine's; the pool is whole again."""
    from engine import AsyncEngine, build_engine
    from engine.llm import make_config
    from tests.engine.helpers import wait_idle

    engine = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=128, max_num_seqs=4, speculative="ngram",
                                                       speculative_device="on"), smollm))
    launches = count_launches(engine.core)
    try:
        async def leave_early():
            async for d in engine.generate(quoting_prompts[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)):
                if d.num_generated_tokens >= 12:
                    break  # the generator is closed: like a disconnected client

        async def read_all():
            return [t async for d in engine.generate(quoting_prompts[2], SamplingParams(temperature=0.0, max_tokens=40)) for t in d.token_ids]

        _, tokens = await asyncio.gather(leave_early(), read_all())
        assert tokens == plain[2].token_ids
        assert launches  # the answers ran on the device
        await wait_idle(engine)
    finally:
        engine.shutdown()
