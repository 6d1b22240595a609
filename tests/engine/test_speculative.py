"""Speculative decoding with n-gram prompt lookup: the proposer, the verification rule (exact at
any temperature), the scheduler's draft rows, and the real engine's output (the same tokens as
without it at temperature 0, fewer steps, no KV block left behind)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.sampling import SampleInput, Sampler
from engine.speculative import Acceptance, AnswerCache, DraftWant, NgramProposer, SpecDecodeStats, accepted_tokens, best_k
from tests.engine.helpers import SimulatedEngine, generate_staggered, make_request



def test_the_longest_recent_match_proposes_what_followed_it():
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    # the 3-gram "7 2 3" beats the more recent 2-gram "2 3"
    assert proposer.propose([7, 2, 3, 8, 8, 2, 3, 6, 6, 7, 2, 3]) == [8, 8, 2]
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]) == [5, 1, 2]  # the most recent of two matches
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []  # nothing repeats
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], limit=1) == [3]  # no drafts past the request's room
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # a match near the end proposes what there is
    with pytest.raises(ValueError, match="k >= 1"):
        NgramProposer(k=0)


@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(1, 6))
def test_a_proposal_is_always_a_continuation_seen_before(tokens, k):
    """Whatever the tokens, the drafts are at most k, and they are the tokens that once followed an
    earlier occurrence of the request's last min_n tokens."""
    proposer = NgramProposer(k=k, min_n=2, max_n=4)
    drafts = proposer.propose(tokens)
    assert len(drafts) <= k
    if drafts:
        tail = tokens[-2:]
        assert any(tokens[i : i + 2] == tail and tokens[i + 2 : i + 2 + len(drafts)] == drafts
                   for i in range(len(tokens) - 2))  # fmt: skip


def scan_proposal(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The proposal by a scan of every earlier window (what NgramIndex answers from its index)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ends = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if ends:
            return tokens[ends[-1] : ends[-1] + k]
    return []


@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.lists(st.integers(1, 7), min_size=1, max_size=8), st.integers(1, 5))
def test_a_request_s_index_grown_step_by_step_proposes_what_a_scan_would(tokens, cuts, k):
    """NgramProposer keeps each request's n-grams indexed as its tokens grow (several tokens a step
    when drafts are accepted): every proposal along the way is the scan's, until released."""
    proposer = NgramProposer(k=k)
    end = 0
    for cut in cuts * 10:
        end = min(end + cut, len(tokens))
        want = DraftWant("r", tokens[:end], k)
        drafts = proposer.propose_batch([want])[0]
        assert drafts == (scan_proposal(tokens[:end], k) if end > 2 else [])
    proposer.release("r")
    assert "r" not in proposer.indexes


@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5),
       st.integers(1, 5))
def test_requests_that_share_a_prefix_propose_what_a_scan_of_their_own_tokens_would(prefix, tails, k):
    """Requests that start alike index only their own tokens after a shared prefix's frozen index
    (SharedPrefixes); each proposal, step by step, is still the scan's over that request's tokens."""
    proposer = NgramProposer(k=k)
    proposer.prefixes.min_tokens, proposer.prefixes.align = 4, 2  # small prefixes share too
    for r, tail in enumerate(tails):
        tokens = prefix + tail
        for end in range(len(prefix) // 2, len(tokens) + 1):
            drafts = proposer.propose_batch([DraftWant(str(r), tokens[:end], k)])[0]
            assert drafts == (scan_proposal(tokens[:end], k) if end > 2 else [])
        proposer.release(str(r))


def test_a_long_shared_prefix_is_indexed_once_for_every_request_that_starts_with_it():
    """The documents in front of every question: the second request's common start with the first
    (cut to a multiple of ``align``) becomes a kept prefix, whose index later requests continue;
    a request that starts otherwise indexes its own tokens."""
    proposer = NgramProposer(k=4)
    documents = [(i * 7919) % 1000 for i in range(600)]
    first, second, third = (documents + [2000 + q, 3000 + q] for q in range(3))
    index = proposer._index(DraftWant("a", first, 4))
    assert index.base is None  # nothing to share yet
    second_index = proposer._index(DraftWant("b", second, 4))
    third_index = proposer._index(DraftWant("c", third, 4))
    assert second_index.base is third_index.base is not None
    assert second_index.base.indexed == 575  # 600 shared tokens cut to 576 (align 64): n-grams ending before the last
    assert not third_index.ends and len(proposer.prefixes.entries) == 1
    assert proposer.propose_batch([DraftWant("c", third + documents[:3], 4)])[0] == documents[3:7]  # from the prefix's index
    again = third + documents[:3] + [9999] + documents[:3]  # its own, later occurrence comes first
    assert proposer.propose_batch([DraftWant("c", again, 4)])[0] == [9999] + documents[:3]
    other = proposer._index(DraftWant("d", [5] * 300 + documents, 4))
    assert other.base is None and len(proposer.prefixes.entries) == 1  # shares nothing with "c"


def test_an_n_gram_the_request_never_continued_drafts_what_a_kept_answer_said_next():
    """The request's own tokens first; failing them, the most recent kept answer with the longest
    n-gram; a released request's output joins the answers, and the oldest answers go first once
    they hold more than the cache's capacity."""
    cache = AnswerCache(capacity=12, min_n=2, max_n=3)
    proposer = NgramProposer(k=3, min_n=2, max_n=3, answers=cache)
    proposer.release("earlier", [50, 51, 52, 53, 54, 55])
    assert proposer.propose([9, 8, 50, 51]) == [52, 53, 54]  # not in the request, in the answer
    assert proposer.propose([50, 51, 9, 50, 51]) == [9, 50, 51]  # the request's own continuation first
    proposer.release("later", [7, 51, 52, 60, 61])
    assert proposer.propose([1, 51, 52]) == [60, 61]  # the more recent answer
    assert proposer.propose([50, 51, 52]) == [53, 54, 55]  # the longer n-gram beats the recent one
    proposer.release("third", [80, 81, 82, 83])  # 15 tokens kept > 12: the first answer goes
    assert sorted(cache.answers) == [1, 2] and cache.num_tokens == 9
    assert proposer.propose([9, 8, 50, 51]) == [] and proposer.propose([2, 80, 81]) == [82, 83]
    proposer.release("short", [5, 6])  # no n-gram with a token after it: nothing to keep
    assert cache.num_tokens == 9
    cache.clear()
    assert proposer.propose([2, 80, 81]) == [] and not cache.ends
    with pytest.raises(ValueError, match="capacity >= 1"):
        AnswerCache(capacity=0)
    with pytest.raises(ValueError, match="its own n-grams"):
        NgramProposer(k=3, answers=AnswerCache(capacity=12, min_n=3))


def scan_answers(answers: list[list[int]], tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """What AnswerCache.lookup answers, by a scan of the kept answers: the latest end of the
    longest n-gram ending ``tokens`` that has a token after it."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        hits = [(a, end) for a, answer in enumerate(answers) for end in range(n, len(answer))
                if answer[end - n : end] == tokens[-n:]]
        if hits:
            a, end = hits[-1]
            return answers[a][end : end + k]
    return []


@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=0, max_size=6), st.integers(1, 4), st.integers(3, 30))
def test_the_answer_cache_drafts_what_a_scan_of_the_kept_answers_would(answers, tokens, k, capacity):
    """Whatever the answers and however many were dropped (and the index rebuilt), a lookup is the
    scan's over the answers kept; the index never holds more than a few times the capacity."""
    cache = AnswerCache(capacity=capacity)
    kept: list[list[int]] = []
    for answer in answers:
        cache.add(answer)
        if len(answer[-capacity:]) > 2:
            kept.append(answer[-capacity:])
        while sum(map(len, kept)) > capacity:
            kept.pop(0)
        assert list(cache.answers.values()) == kept
        assert cache.lookup(tokens, k) == scan_answers(kept, tokens, k)
        assert len(cache.ends) <= 3 * 2 * capacity  # n = 2, 3, 4 of the kept and the not yet rebuilt


def test_verification_keeps_samples_up_to_the_first_rejected_draft():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the sample after them
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the second draft rejected: its sample replaces it
    assert accepted_tokens([5], [4, 3]) == [4]
    assert accepted_tokens([], [4]) == [4]
    with pytest.raises(ValueError, match="2 drafts need 3 samples"):
        accepted_tokens([1, 2], [1, 2])


def test_verifying_a_draft_by_sampling_keeps_the_targets_distribution():
    """Exact rejection sampling for a one-token draft: the first token a verifying step keeps has
    the target's distribution p, whichever token was drafted (here the likeliest, an unlikely one,
    and one top-k filters out)."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    params = SamplingParams(temperature=0.8, top_k=4)
    filtered = logits.clone()
    filtered[3] = float("-inf")
    p = torch.softmax(filtered / 0.8, -1)
    sampler = Sampler(torch.Generator().manual_seed(1))
    n = 20_000
    rows = [SampleInput(params, [0], [], None)] * n
    for draft in (0, 4, 3):
        # the step's sample at the draft's position: one row of the target's logits per trial
        samples = sampler(logits.expand(n, -1).contiguous(), rows).token_ids
        kept = [accepted_tokens([draft], [s, 0])[0] for s in samples]
        freq = torch.bincount(torch.tensor(kept), minlength=5).float() / n
        assert torch.allclose(freq, p, atol=0.012), (draft, freq, p)


def test_drafts_are_proposed_only_as_many_as_pay_at_the_measured_acceptance():
    """k maximizes expected tokens (1 + a + ... + a^k) per step cost (1 + row_cost * k): none when
    drafts are rarely accepted or rows are dear, all of them when rows are nearly free (a GPU step
    bound by reading the weights)."""
    assert [best_k(a, 0.45, 4) for a in (0.3, 0.5, 0.8, 0.9, 0.95)] == [0, 1, 2, 3, 4]
    assert best_k(0.5, 0.02, 4) == 4 and best_k(0.99, 5.0, 4) == 0
    acc = Acceptance()
    for _ in range(6):
        acc.update(4, 4)  # every draft accepted: the estimate climbs towards 1
    assert acc.rate > 0.95 and best_k(acc.rate, 0.45, 4) == 4
    for _ in range(6):
        acc.update(2, 0)  # the first draft rejected each time: one decision, no acceptance
    assert acc.rate < 0.4 and best_k(acc.rate, 0.45, 4) == 0
    for _ in range(10):
        acc.rest()  # steps without drafts: back towards the prior, so that it tries again
    assert best_k(acc.rate, 0.45, 4) == 1


class WrongGuesses(NgramProposer):
    """Always proposes token 0, which the model never says here: every draft is rejected."""

    def propose(self, tokens, limit=None, index=None):
        return [0] * min(self.k, limit or self.k)


def test_a_request_whose_drafts_are_rejected_stops_drafting(smollm, llm_gguf_path, quoting_prompts, plain_tokens):
    """The real engine with drafts that are always wrong: the answer is still plain decoding's, and
    after a rejection or two the request proposes none for several steps at a time (its acceptance
    estimate fell; it tries one draft again now and then)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = list(plain_tokens[2][:30])
    spec = spec_llm(smollm, llm_gguf_path)
    spec.core.proposer = WrongGuesses(k=4)
    assert spec.generate(quoting_prompts[2:], params)[0].token_ids == want
    stats = spec.core.spec_stats
    assert stats.num_accepted_tokens == 0 and 1 <= stats.num_drafts <= 10 and stats.num_draft_tokens <= 10  # in ~30 steps, not 4 a step
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_stats_count_drafts_and_acceptance_by_position():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(3, 3)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.accepted_per_pos == [2, 2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(5 / 9) and stats.mean_accepted_length == pytest.approx(1 + 5 / 3)


def test_the_scheduler_gives_a_decode_one_row_per_draft_within_the_budget():
    eng = SimulatedEngine(num_blocks=100, block_size=4, max_num_batched_tokens=8)
    a = eng.add(make_request("a", 5, max_tokens=20))
    b = eng.add(make_request("b", 3, max_tokens=20, start_token=100))
    eng.step()  # both prefilled (5 + 3 tokens), first tokens out
    a.draft_token_ids, b.draft_token_ids = [1, 2, 3, 4], [9, 9, 9, 9, 9]
    out = eng.scheduler.schedule()
    got = {c.request.request_id: (c.num_tokens, c.drafts) for c in out.chunks}
    assert got == {"a": (5, [1, 2, 3, 4]), "b": (3, [9, 9])}  # 8 tokens: b's drafts trimmed to what is left
    assert all(c.completes_prompt for c in out.chunks)
    assert len(a.block_ids) * 4 >= a.num_computed_tokens + 5  # KV slots for the drafts too


def spec_llm(smollm, llm_gguf_path, **kw) -> LLM:
    return LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, speculative="ngram", **kw)


class Answer(NamedTuple):
    """A finished greedy answer, frozen: its tokens, text and each token's log-prob."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]


@pytest.fixture(scope="module")
def plain_answers(smollm, llm_gguf_path, quoting_prompts) -> tuple[Answer, ...]:
    """Plain decoding's greedy answer (40 tokens at most, with log-probs) to each quoting prompt
    alone, computed once: what speculation must reproduce."""
    plain = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
    outs = [plain.generate([p], params)[0] for p in quoting_prompts]
    return tuple(Answer(tuple(o.token_ids), o.text, tuple(next(iter(e.values())) for e in o.logprobs)) for o in outs)


@pytest.fixture(scope="module")
def plain_tokens(smollm, llm_gguf_path, quoting_prompts) -> tuple[tuple[int, ...], ...]:
    """Plain decoding's first 40 greedy tokens after each quoting prompt alone, EOS ignored,
    computed once: a greedy run of n <= 40 tokens (EOS ignored) is the first n of them."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return tuple(tuple(LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate([p], params)[0].token_ids)
                 for p in quoting_prompts)


def test_greedy_output_is_the_same_with_fewer_steps(smollm, llm_gguf_path, quoting_prompts, plain_answers):
    """The real model, each prompt alone and all three batched: the same tokens as without
    speculation, drafts accepted, fewer steps than tokens, and every KV block back in the pool."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
    want = plain_answers
    spec = spec_llm(smollm, llm_gguf_path)
    alone = []
    for p in quoting_prompts:
        spec.core.num_steps = 0
        alone.append(spec.generate([p], params)[0])
        assert spec.core.num_steps < len(alone[-1].token_ids) + 1 or spec.core.spec_stats.num_accepted_tokens == 0
    assert [tuple(o.token_ids) for o in alone] == [a.token_ids for a in want]
    assert [o.text for o in alone] == [a.text for a in want]
    for got, ref in zip(alone, want):  # the log-prob of each kept token, from the verifying step's rows
        assert [next(iter(e.values())) for e in got.logprobs] == pytest.approx(list(ref.logprobs), abs=2e-3)
    stats = spec.core.spec_stats
    assert stats.num_accepted_tokens > 10 and 0 < stats.acceptance_rate <= 1
    batched = spec.generate(quoting_prompts, params)
    assert [tuple(o.token_ids) for o in batched] == [a.token_ids for a in want]
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_verifying_steps_replay_row_graphs_with_the_same_output(async_scheduling, smollm, llm_gguf_path, quoting_prompts, plain_answers):
    """Row graphs (engine/cuda_graph.py): each verifying step, a row per token with its own context
    length and its request's block table, packed and scattered like a decode graph's step and
    padded to a row bucket, greedy tokens from the step's own argmax; the three prompts alone and
    batched give the plain engine's tokens. With async scheduling the drafts go ahead of the decode
    graph's step in flight: the row graph's first row per request reads that step's token. On a
    GPU each bucket is one CUDA graph; here the same scatter, rows and argmax run eagerly."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = [list(a.token_ids) for a in plain_answers]
    spec = spec_llm(smollm, llm_gguf_path, async_scheduling=async_scheduling)
    runner = spec.core.runner
    runner.capture_cuda_graphs([1, 2, 4], spec.core.max_model_len, spec.core.config.max_num_seqs)
    runner.capture_row_graphs([2, 4, 8, 16], 5, spec.core.max_model_len, spec.core.config.max_num_seqs)
    verifying = []  # row-graph steps, by the tokens they verify
    prepare = runner.prepare

    def spy(chunks, pending=None):
        inputs = prepare(chunks, pending)
        if inputs.graph is not None and inputs.graph.rows_are_tokens:
            verifying.append(inputs.num_tokens)
        return inputs

    runner.prepare = spy
    assert [spec.generate([p], params)[0].token_ids for p in quoting_prompts] == want
    assert [o.token_ids for o in spec.generate(quoting_prompts, params)] == want
    assert verifying and max(verifying) > 5  # steps of several requests' rows too
    assert runner.row_graphs.padding_rows > 0 and spec.core.spec_stats.num_accepted_tokens > 10
    assert (spec.core.spec_stats.num_guesses_right > 0) == (async_scheduling == "on")
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_a_request_that_decoded_in_a_batch_too_large_to_draft_never_drafts(smollm, llm_gguf_path, quoting_prompts, plain_tokens):
    """Async scheduling with speculation: while more than ``speculative_max_batch`` requests decode,
    steps overlap the host's work (each launched before the previous one is read back), without
    drafts; the two long answers left once four short ones finish still draft nothing (they
    decoded in the large batch: its tail is where drafting lost). A request that then comes alone
    drafts, launched behind the step in flight. Without async scheduling (the CPU's steps) the
    tail drafts. Greedy output as without either."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = quoting_prompts * 2  # six requests: above a speculative_max_batch of 2 until four finish
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [list(plain_tokens[i % 3][:n]) for i, n in enumerate([8] * 4 + [30] * 2)]
    spec = spec_llm(smollm, llm_gguf_path, async_scheduling="on", speculative_max_batch=2)
    chained = []  # per launched step: whether the step before it was still in flight (its drafts, if any)
    launch = spec.core._launch

    def spy(inputs):
        step = launch(inputs)
        chained.append((step.chained, any(c.drafts for c in inputs.chunks)))
        return step

    spec.core._launch = spy
    assert [o.token_ids for o in spec.generate(prompts, [short] * 4 + [params] * 2)] == want
    assert (True, False) in chained and not any(drafted for _, drafted in chained)
    assert spec.core.spec_stats.num_drafts == 0
    chained.clear()
    assert spec.generate(quoting_prompts[:1], params)[0].token_ids == list(plain_tokens[0][:30])
    assert (True, True) in chained and spec.core.spec_stats.num_accepted_tokens > 0
    assert all(not now[0] for before, now in zip(chained, chained[1:]) if before[1])  # a verifying step is read back at once
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total
    sync = spec_llm(smollm, llm_gguf_path, async_scheduling="off", speculative_max_batch=2)
    assert [o.token_ids for o in sync.generate(prompts, [short] * 4 + [params] * 2)] == want
    assert sync.core.spec_stats.num_accepted_tokens > 0


def test_with_async_scheduling_n_gram_drafts_go_ahead_of_the_step_in_flight(smollm, llm_gguf_path, quoting_prompts, plain_tokens):
    """Async scheduling, one request at a time: n-gram drafts are proposed on the tokens the host
    knows, one token more than the drafts, the first a guess of the token still in flight; the
    verifying step is launched behind that step (its first input read on the device) instead of
    waiting for it. Only the step after a verifying one waits (the verification decides its
    tokens). The answer about annual leave quotes the handbook in places and not in others, so
    guesses are right and wrong; the output is plain decoding's either way, with fewer steps.
    Each launch after a verifying step is accounted as one after a read back (the device idled
    for the host's turnaround), and no other."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = list(plain_tokens[1])
    spec = spec_llm(smollm, llm_gguf_path, async_scheduling="on", speculative_row_cost=0.05)
    chained = []  # per launched decode step: (launched while the one before was in flight, with drafts)
    after_read_back = []  # per launched decode step: launched after the step before was read back at once
    launch = spec.core._launch

    def spy(inputs):
        step = launch(inputs)
        if all(not c.request.is_prefilling or c.drafts for c in inputs.chunks):
            chained.append((step.chained, any(c.drafts for c in inputs.chunks)))
            after_read_back.append(step.after_read_back)
        return step

    spec.core._launch = spy
    assert spec.generate(quoting_prompts[1:2], params)[0].token_ids == want
    assert chained.count((True, True)) >= 3 and chained.count((True, False)) >= 3
    assert all(now[0] or before[1] for before, now in zip(chained, chained[1:]))  # only a verifying step is waited for
    assert after_read_back[1:] == [before[1] for before in chained[:-1]] and not after_read_back[0]
    times = spec.core.step_times
    assert times.read_back_launches == sum(after_read_back) >= 3 and times.read_back_turnaround > 0
    stats = spec.core.spec_stats
    assert stats.num_accepted_tokens > 5 and 0 < stats.num_guesses_right <= stats.num_drafts_ahead <= stats.num_drafts
    assert len(chained) < len(want)
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_a_wrong_guess_of_the_token_in_flight_costs_only_its_drafts(smollm, llm_gguf_path, quoting_prompts, plain_tokens):
    """A proposer whose first token is always another one (the guess of the token in flight when
    it drafts ahead, else the first draft): the output is still plain decoding's, and every guess
    is counted wrong."""
    from engine.speculative import NgramProposer

    class WrongGuess(NgramProposer):
        def propose_batch(self, wants):
            return [[p[0] ^ 1, *p[1:]] if p else p for p in super().propose_batch(wants)]

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = spec_llm(smollm, llm_gguf_path, async_scheduling="on", speculative_row_cost=0.05)
    spec.core.proposer = WrongGuess(spec.core.proposer.k)
    assert spec.generate(quoting_prompts[1:2], params)[0].token_ids == list(plain_tokens[1][:30])
    stats = spec.core.spec_stats
    assert stats.num_drafts_ahead > 0 and stats.num_guesses_right == 0
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_a_question_asked_again_drafts_its_earlier_answer(smollm, llm_gguf_path):
    """The real engine, one question asked twice: with the answer cache the second answer is
    drafted from the first (nearly every draft accepted, far fewer steps than tokens); with prompt
    lookup alone (an answer that does not quote its prompt) few drafts are; the tokens are plain
    decoding's either way, and every KV block is back in the pool."""
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Write three sentences about the sea."}])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate([prompt], params)[0].token_ids
    accepted, steps = {}, {}
    for cache_tokens in (0, 4096):
        spec = spec_llm(smollm, llm_gguf_path, speculative_answer_cache_tokens=cache_tokens, speculative_row_cost=0.05)
        assert spec.generate([prompt], params)[0].token_ids == want
        spec.core.spec_stats, spec.core.num_steps = SpecDecodeStats(), 0
        assert spec.generate([prompt], params)[0].token_ids == want
        accepted[cache_tokens], steps[cache_tokens] = spec.core.spec_stats.num_accepted_tokens, spec.core.num_steps
        assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total
    assert accepted[4096] >= 25 and steps[4096] <= 15, (accepted, steps)  # 28 and 12 of 40 tokens (2-core CPU)
    assert accepted[0] <= accepted[4096] - 20, (accepted, steps)


def test_a_verifying_step_is_read_back_before_the_next_is_scheduled(smollm, llm_gguf_path, quoting_prompts, plain_tokens):
    """Async scheduling, speculation for one decoding request at most: a prompt whose prefill ends
    in the step that verifies the other request's drafts makes the next step too large to draft,
    so nothing else reads the verifying step back first; it must have been read back already (the
    next step was scheduled on its unverified drafts and failed: tokens not known to the host).
    Its proposer has every step read back for drafts (it does not draft ahead), as a draft
    model's does, so that the drafts come at the steps that met the failure."""
    from engine.speculative import NgramProposer

    class EveryStep(NgramProposer):
        @property
        def drafts_ahead(self):
            return False

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [list(t[:30]) for t in plain_tokens[:2]]
    spec = spec_llm(smollm, llm_gguf_path, async_scheduling="on", speculative_max_batch=1, long_prefill_token_threshold=8)
    spec.core.proposer = EveryStep(spec.core.proposer.k)
    assert generate_staggered(spec.core, quoting_prompts[:2], params, steps_between=24) == want
    assert spec.core.spec_stats.num_accepted_tokens > 0
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_row_graph_buckets_cover_the_largest_verifying_step():
    from engine.config import EngineConfig
    from engine.engine_builder import row_graph_sizes

    assert row_graph_sizes(EngineConfig(model="m")) == []  # no speculation, no row graphs
    assert row_graph_sizes(EngineConfig(model="m", speculative="ngram")) == [2, 4, 8, 16, 24, 32, 40]
    assert row_graph_sizes(EngineConfig(model="m", speculative="ngram", num_speculative_tokens=2, speculative_max_batch=1)) == [2, 3]
    assert row_graph_sizes(EngineConfig(model="m", speculative="ngram", row_cuda_graphs="off")) == []


@pytest.mark.parametrize("device", ["off", "on"])
def test_a_stop_among_accepted_drafts_ends_the_answer_there(device, smollm, llm_gguf_path, quoting_prompts):
    """max_tokens, a stop string and the context's end cut a verified run of tokens exactly where
    a plain engine stops; with device speculation (engine/device_speculation.py) too, where the
    host learns each step's tokens a step late."""
    plain = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, max_model_len=len(quoting_prompts[0]) + 30)
    spec = spec_llm(smollm, llm_gguf_path, max_model_len=len(quoting_prompts[0]) + 30, speculative_device=device)
    for params in (SamplingParams(temperature=0.0, max_tokens=7), SamplingParams(temperature=0.0, max_tokens=200, stop=["HR-01"]),
                   SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)):  # fmt: skip
        want = plain.generate(quoting_prompts[:1], params)[0]
        got = spec.generate(quoting_prompts[:1], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_sampled_answers_and_big_batches_run_and_leave_no_blocks(smollm, llm_gguf_path, quoting_prompts):
    """Temperature 1 with top-p (verified by sampling every row), penalties (no drafts: they read
    the outputs), and a batch above speculative_max_batch (no drafts): all finish, blocks freed."""
    spec = spec_llm(smollm, llm_gguf_path, speculative_max_batch=2)
    out = spec.generate(quoting_prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=3))
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in out)
    spec.core.spec_stats = SpecDecodeStats()
    spec.generate(quoting_prompts[:1], SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2))
    assert spec.core.spec_stats.num_drafts == 0
    spec.generate(quoting_prompts * 2, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert spec.stats().kv_blocks_free == spec.stats().kv_blocks_total


def test_unsupported_combinations_are_refused_at_start(smollm, llm_gguf_path):
    with pytest.raises(ConfigError, match="leaves no room"):
        spec_llm(smollm, llm_gguf_path, num_speculative_tokens=64, max_model_len=64)
    with pytest.raises(ConfigError, match="speculative must be"):
        LLM(str(llm_gguf_path), loaded=smollm, speculative="medusa")
    for sizes in ((0, 4), (3, 2), (1, 2, 3)):
        with pytest.raises(ConfigError, match=r"speculative_ngram_sizes must be \(min, max\) with 1 <= min <= max"):
            spec_llm(smollm, llm_gguf_path, speculative_ngram_sizes=sizes)


def test_the_ngram_sizes_reach_the_proposer_and_its_answers(smollm, llm_gguf_path):
    """speculative_ngram_sizes: the engine's proposer and its answer cache look up those lengths; a
    1-gram then proposes where the default's 2-grams find nothing."""
    spec = spec_llm(smollm, llm_gguf_path, speculative_ngram_sizes=(1, 8))
    proposer = spec.core.proposer
    assert (proposer.min_n, proposer.max_n) == (1, 8) and (proposer.answers.min_n, proposer.answers.max_n) == (1, 8)
    assert proposer.propose([5, 6, 7, 9, 5]) == [6, 7, 9, 5]
    default = spec_llm(smollm, llm_gguf_path).core.proposer
    assert (default.min_n, default.max_n) == (2, 4) and default.propose([5, 6, 7, 9, 5]) == []


def test_a_draft_row_costs_what_was_measured_on_the_device_unless_set(smollm, llm_gguf_path):
    """speculative_row_cost unset: the device's measured cost (dear on the CPU, nearly free on CUDA),
    which the engine prices drafts at; set, the setting on any device."""
    assert EngineConfig(model="m").row_cost("cpu") == 0.45 and EngineConfig(model="m").row_cost("cuda") == 0.05
    assert EngineConfig(model="m", speculative_row_cost=0.2).row_cost("cuda") == 0.2
    assert spec_llm(smollm, llm_gguf_path).core.row_cost == 0.45  # this engine runs on the CPU
    assert spec_llm(smollm, llm_gguf_path, speculative_row_cost=0.05).core.row_cost == 0.05
    with pytest.raises(ConfigError, match="speculative_row_cost must be >= 0"):
        spec_llm(smollm, llm_gguf_path, speculative_row_cost=-0.1)


def test_metrics_show_drafts_and_acceptance_under_vllms_names(smollm, llm_gguf_path, quoting_prompts):
    """A real server on a speculating engine: one completion over HTTP, then /metrics counts its
    drafts, accepted drafts and acceptance by position, as the engine does."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from engine import AsyncEngine, build_engine
    from engine.llm import make_config
    from engine.serving.server import BackgroundServer, create_app

    engine = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=128, speculative="ngram"), smollm))
    try:
        with BackgroundServer(create_app(engine, "spec")) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "spec", "prompt": quoting_prompts[0], "max_tokens": 40,
                                                              "temperature": 0}, timeout=120)  # fmt: skip
            assert r.status_code == 200, r.text
            samples = {}
            for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
                for s in family.samples:
                    samples[s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")] = s.value
    finally:
        engine.shutdown()
    stats = engine.core.spec_stats
    assert stats.num_accepted_tokens > 0
    assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_drafts
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert [samples[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(len(stats.accepted_per_pos))] == stats.accepted_per_pos
