"""Async scheduling (step N+1 launched before step N's samples reach the host) changes no output.

On the CPU the forward runs on the host, so the overlap itself buys nothing here; what these
tests pin down is the bookkeeping that makes it correct on a GPU: decodes read their input
token from the previous step's samples on the device, a request whose last token is pending is
not scheduled again, a token learned after a stop or an abort is dropped, penalties see every
earlier token, and no KV block leaks. They run on whatever device is present (the H200 run of
this file exercises the real overlap).
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


def prompts(n: int, seed: int = 0, vocab: int = 301) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def engine(model_dir, mode: str, **options) -> LLM:
    return LLM(str(model_dir), async_scheduling=mode, **{"num_kv_blocks": 96, "block_size": 4, **options})


def generate(model_dir, mode: str, ps, params, **options):
    llm = engine(model_dir, mode, **options)
    out = llm.generate(ps, params)
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    assert not llm.core.has_unfinished_requests()
    return llm, out


def summary(outputs):
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in outputs]


def test_the_engine_overlaps_only_where_asked(tiny_llama_dir):
    assert engine(tiny_llama_dir, "on").core.async_scheduling
    assert not engine(tiny_llama_dir, "off").core.async_scheduling
    auto = engine(tiny_llama_dir, "auto").core
    assert auto.async_scheduling == (auto.device.type == "cuda")


def test_greedy_outputs_lengths_and_stop_tokens_match_the_synchronous_engine(tiny_llama_dir):
    ps = prompts(6)
    probe = generate(tiny_llama_dir, "off", ps[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[1][0]
    stop_id = probe.token_ids[4]  # a token this request really emits: it stops there
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 7, 20, 33)]
    params.insert(0, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]))
    _, sync = generate(tiny_llama_dir, "off", ps, params)
    llm, overlapped = generate(tiny_llama_dir, "on", ps, params)
    assert summary(overlapped) == summary(sync)
    assert sync[0].finish_reason == "stop" and sync[0].token_ids[-1] == stop_id
    assert [len(o.token_ids) for o in overlapped[1:]] == [1, 2, 7, 20, 33]


def test_a_request_whose_last_token_is_pending_is_not_decoded_again(tiny_llama_dir):
    for mode in ("off", "on"):
        llm, out = generate(tiny_llama_dir, mode, prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert len(out[0].token_ids) == 6
        assert llm.core.num_steps == 6, f"{mode}: {llm.core.num_steps} steps launched for 6 tokens"


def test_preemption_under_a_tiny_pool_and_chunked_prefill_changes_nothing(tiny_llama_dir):
    ps = prompts(8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(num_kv_blocks=40, max_num_batched_tokens=32, enable_prefix_caching=False)
    _, sync = generate(tiny_llama_dir, "off", ps, params, **options)
    llm, overlapped = generate(tiny_llama_dir, "on", ps, params, **options)
    assert llm.stats().num_preemptions > 0  # the pool really forced recomputation
    assert summary(overlapped) == summary(sync)


def test_penalties_seeded_sampling_and_logprobs_match_the_synchronous_engine(tiny_llama_dir):
    ps = prompts(5, seed=5)
    params = [
        # negative penalties reward the tokens already emitted: the latest one decides the next
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=3.0, frequency_penalty=1.5),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True, presence_penalty=1.0),
    ]
    _, sync = generate(tiny_llama_dir, "off", ps, params)
    _, overlapped = generate(tiny_llama_dir, "on", ps, params)
    assert summary(overlapped) == summary(sync)
    for a, b in zip(sync[3].logprobs, overlapped[3].logprobs):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-5) for k in a)


def test_an_abort_while_its_token_is_in_flight_drops_the_token_and_frees_its_blocks(tiny_llama_dir):
    ps = prompts(3, seed=9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, reference = generate(tiny_llama_dir, "off", ps, params)
    llm = engine(tiny_llama_dir, "on")
    core = llm.core
    reqs = [core.add_request(p, params) for p in ps]
    seen: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(4):
        for out in core.step():
            seen[out.request_id] += out.token_ids
    victim = reqs[1]
    assert victim.num_pending_tokens == 1  # its next token is still on the device
    assert core.abort_request(victim.request_id)
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.request_id != victim.request_id, "a dropped token reached the aborted request"
            seen[out.request_id] += out.token_ids
    assert seen[reqs[0].request_id] == reference[0].token_ids
    assert seen[reqs[2].request_id] == reference[2].token_ids
    assert victim.output_token_ids == reference[1].token_ids[: len(victim.output_token_ids)]
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_prefix_cache_registers_the_same_blocks_as_the_synchronous_engine(tiny_llama_dir):
    """Blocks completed by a sampled token are hashed only once the host knows that token."""
    p = prompts(1, seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    cached = {}
    for mode in ("off", "on"):
        llm = engine(tiny_llama_dir, mode)
        first = llm.generate([p], params)[0]
        follow_up = p + first.token_ids + [5, 6, 7]  # the next turn of the conversation
        second = llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        cached[mode] = (second.num_cached_tokens, second.token_ids)
    assert cached["on"] == cached["off"]
    assert cached["on"][0] >= len(p)  # the whole first turn was found again


def test_stop_strings_and_eos_on_the_real_model_match_the_synchronous_engine(smollm, llm_gguf_path):
    """Text, stop strings and EOS: the token after a stop is computed and dropped, never shown."""
    chat = [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in ("How do I apply for annual leave?", "年假怎么申请？", "Count from one to ten.")]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[" the"]), SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=12)]
    results = {}
    for mode in ("off", "on"):
        llm = LLM(str(llm_gguf_path), loaded=smollm, async_scheduling=mode, num_kv_blocks=64)
        results[mode] = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in llm.generate(chat, params)]
        assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total
    assert results["on"] == results["off"]
    assert results["on"][0][2] == "stop" and results["on"][0][3] == " the"
