"""Speculative decoding with a draft model (engine/draft_model.py): a smaller model's greedy tokens
verified by the target. The real SmolLM2 as target with its own int4 copy as draft (the same
tokenizer, slightly different numbers), and a random draft of the same vocabulary whose every
draft is wrong: the answers stay plain decoding's, the draft's KV is rolled back exactly after
each verification, and neither engine keeps a block."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LoadedModel, SamplingParams
from engine.config import ConfigError
from engine.draft_model import DraftModelProposer
from engine.engine_builder import build_engine
from engine.llm import make_config
from engine.prefix_cache import extend_block_hashes
from engine.speculative import DraftWant
from tests.engine.conftest import save_tiny_llama

QUOTE = ("Annual leave: every employee gets 20 days of paid annual leave a year. Request it in PeopleHub with form "
         "HR-01 at least 10 working days before the first day, and your manager approves it.")


@pytest.fixture(scope="module")
def prompts(smollm):
    ask = [f"{QUOTE}\n\nHow many days of annual leave do I get?", "Count from one to twenty in words, separated by commas.",
           "Write two sentences about the sea."]
    return [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in ask]


@pytest.fixture(scope="module")
def plain_answers(smollm, llm_gguf_path, prompts) -> tuple[tuple[int, ...], ...]:
    """Plain decoding's greedy tokens (40 at most) for the three prompts batched, computed once:
    what drafting must reproduce."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return tuple(tuple(o.token_ids) for o in LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate(prompts, params))


def draft_llm(smollm, draft, path, **kw) -> LLM:
    """An engine drafting with ``draft``; its steps priced as on a launch-bound GPU (a draft row and a
    draft step cheap), so that requests draft whenever drafts are accepted."""
    return LLM(str(path), loaded=smollm, draft_loaded=draft, num_kv_blocks=128, speculative="draft", draft_model=str(path),
               speculative_row_cost=0.05, speculative_draft_cost=0.05, **kw)


def all_blocks_free(llm: LLM) -> bool:
    draft = llm.core.proposer.draft.block_manager
    stats = llm.stats()
    return stats.kv_blocks_free == stats.kv_blocks_total and draft.num_free_blocks == draft.num_usable_blocks


def test_greedy_answers_are_plain_decodings_in_fewer_steps(smollm, smollm_int4, llm_gguf_path, prompts, plain_answers):
    """Each prompt alone and all three batched: token for token the plain engine's answers, most
    drafts accepted, far fewer target steps than tokens, no mirror or KV block left behind."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = [list(t) for t in plain_answers]
    spec = draft_llm(smollm, smollm_int4, llm_gguf_path)
    for prompt, ref in zip(prompts, want):
        spec.core.num_steps = 0
        assert spec.generate([prompt], params)[0].token_ids == ref
        assert spec.core.num_steps < len(ref) // 2  # a verifying step appends several tokens
    stats = spec.core.spec_stats
    assert stats.acceptance_rate > 0.6 and stats.num_accepted_tokens > 40
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert not spec.core.proposer.mirrors and all_blocks_free(spec)
    assert spec.core.proposer.times.steps > 0


def test_target_and_draft_steps_replay_their_graphs_with_the_same_answers(smollm, llm_gguf_path, prompts, plain_answers):
    """As on a GPU: the target's verifying steps replay its row graphs, the draft's one-token steps
    its decode graphs and its catch-up steps (the accepted tokens, two when every draft was taken)
    its row graphs; the draft engine's config turns row graphs on. Greedy answers unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = [list(t) for t in plain_answers]
    spec = draft_llm(smollm, smollm, llm_gguf_path)
    draft = spec.core.proposer.draft
    assert draft.config.row_cuda_graphs == "on"
    for core in (spec.core, draft):
        core.runner.capture_cuda_graphs([1, 2, 4], core.max_model_len, core.config.max_num_seqs)
        core.runner.capture_row_graphs([2, 4, 8, 16], 5, core.max_model_len, core.config.max_num_seqs)
    row_steps = {"target": 0, "draft": 0}
    for name, runner in (("target", spec.core.runner), ("draft", draft.runner)):
        def spy(chunks, pending=None, prepare=runner.prepare, name=name):
            inputs = prepare(chunks, pending)
            row_steps[name] += inputs.graph is not None and inputs.graph.rows_are_tokens
            return inputs
        runner.prepare = spy
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert row_steps["target"] > 0 and row_steps["draft"] > 0 and draft.runner.graphs.padding_rows > 0
    assert all_blocks_free(spec)


def test_a_draft_that_is_always_wrong_changes_nothing_and_stops_drafting(smollm, llm_gguf_path, prompts, tmp_path):
    """A random draft model of the same vocabulary: every draft is rejected, the answers are still
    plain decoding's, and the requests soon stop asking it (their acceptance estimate fell)."""
    vocab = smollm.model_config.vocab_size
    random_draft = LoadedModel.load(EngineConfig(model=str(save_tiny_llama(tmp_path / "draft", seed=7, vocab_size=vocab,
                                                                           max_position_embeddings=8192))))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).generate(prompts, params)]
    spec = draft_llm(smollm, random_draft, llm_gguf_path)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.core.spec_stats
    # 90 one-token steps: 4 drafts in each would be 360; after a rejection or two a request drafts
    # one now and then (its acceptance estimate fell, and drafts priced this cheap are tried again)
    assert stats.num_accepted_tokens <= 2 and stats.num_draft_tokens < 120
    assert all_blocks_free(spec)


def test_after_a_verification_the_draft_continues_from_the_targets_tokens(smollm, smollm_int4, llm_gguf_path, prompts):
    """The mirror cut back past a rejected draft: its next drafts are exactly what a fresh draft
    engine says greedily after the same tokens (the KV of the rejected tokens was computed over)."""
    config = make_config(str(llm_gguf_path), num_kv_blocks=64)
    proposer = DraftModelProposer(build_engine(config, smollm_int4))
    fresh = LLM(str(llm_gguf_path), loaded=smollm_int4, num_kv_blocks=64)
    tokens = list(prompts[1])
    drafts = proposer.propose_batch([DraftWant("a", tokens, 4)])[0]
    assert drafts == fresh.generate([tokens], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids
    for accepted, correction in ((1, 13), (0, 29), (4, 101)):  # the target kept `accepted` drafts, then said `correction`
        tokens = tokens + drafts[:accepted] + [correction]
        drafts = proposer.propose_batch([DraftWant("a", tokens, 4)])[0]
        assert proposer.mirrors["a"].all_token_ids == tokens + drafts
        assert drafts == fresh.generate([tokens], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids
    proposer.release("a")
    bm = proposer.draft.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    # verified full blocks stay findable, and every block the cache holds is one of the verified
    # tokens' blocks: none holds a rejected draft under its hash
    hashes: list = []
    extend_block_hashes(hashes, tokens, config.block_size)
    assert len(prompts[1]) // config.block_size <= len(bm.prefix_cache) == len(bm.prefix_cache.longest_prefix(hashes))


def test_a_full_draft_cache_means_no_drafts_not_a_failure(smollm, smollm_int4, llm_gguf_path, prompts, plain_answers):
    """A draft engine whose KV cache cannot hold the prompt: no drafts, no mirror, no block held;
    the target engine with such a draft still answers as plain decoding does."""
    proposer = DraftModelProposer(build_engine(make_config(str(llm_gguf_path), num_kv_blocks=3), smollm_int4))
    assert proposer.propose_batch([DraftWant("a", list(prompts[0]), 4)]) == [[]]
    assert not proposer.mirrors and proposer.draft.block_manager.num_free_blocks == 2
    params = SamplingParams(temperature=0.0, max_tokens=20)
    want = list(plain_answers[0][:20])  # a greedy run of 20 tokens is the first 20 of the 40
    spec = draft_llm(smollm, smollm_int4, llm_gguf_path)
    spec.core.proposer = proposer
    assert spec.generate(prompts[:1], params)[0].token_ids == want


def test_sampled_and_aborted_requests_release_their_mirrors(smollm, smollm_int4, llm_gguf_path, prompts):
    """Temperature 1 runs to the end through drafts verified by sampling; a request aborted mid-answer
    frees its mirror's blocks in the draft engine; the memory ledger names the draft's weights."""
    spec = draft_llm(smollm, smollm_int4, llm_gguf_path)
    out = spec.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=25, seed=4))
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in out)
    core = spec.core
    req = core.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(4):
        core.step()
    assert req.request_id in core.proposer.mirrors
    assert core.abort_request(req.request_id)
    assert not core.proposer.mirrors and all_blocks_free(spec)
    owners = [owner for owner, _ in core.memory_rows()]
    assert "draft model: weights" in owners and any(o.startswith("draft model: kv_cache") for o in owners)


def test_unsupported_draft_models_are_refused_at_start(smollm, llm_gguf_path, tiny_llama_dir, qwen_0_5b_gguf, monkeypatch):
    """Another tokenizer is refused: a GGUF's from its tokenizer alone, before its weights or the
    target's load (the 0.5B Qwen's took 10 s on a 2-core CPU only to be refused), a directory without one by its
    vocabulary's size; a missing path or a draft without draft decoding, at once."""
    import engine.engine_builder as builder

    loads = []
    load = builder.LoadedModel.load
    monkeypatch.setattr(builder.LoadedModel, "load", lambda config, **kw: loads.append(config.model) or load(config, **kw))
    with pytest.raises(ConfigError, match="another tokenizer"):  # Qwen's vocabulary against SmolLM2's
        LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, speculative="draft", draft_model=str(qwen_0_5b_gguf))
    assert loads == []
    with pytest.raises(ConfigError, match="another tokenizer"):  # the same before the target's own weights load
        LLM(str(llm_gguf_path), num_kv_blocks=128, speculative="draft", draft_model=str(qwen_0_5b_gguf))
    assert loads == []
    with pytest.raises(ConfigError, match="another tokenizer"):  # a vocabulary of 301 against SmolLM2's
        LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, speculative="draft", draft_model=str(tiny_llama_dir))
    with pytest.raises(ConfigError, match="go together"):
        LLM(str(llm_gguf_path), loaded=smollm, speculative="draft")
    with pytest.raises(ConfigError, match="go together"):
        LLM(str(llm_gguf_path), loaded=smollm, speculative="ngram", draft_model=str(llm_gguf_path))
    with pytest.raises(ConfigError, match="draft model path does not exist"):
        LLM(str(llm_gguf_path), loaded=smollm, speculative="draft", draft_model="/nonexistent/draft.gguf")
