"""The CPU decode and prefill-chunk paths that read the paged cache through views, against the
gathering reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.backend import AttentionMetadata
from engine.kv_cache import LayerKV
from engine.attention.torch_ref import (
    MAX_VIEW_RUNS,
    TorchReferenceAttention,
    block_runs,
    chunk_view_plan,
    decode_attention_views,
    decode_view_plan,
    paged_attention_reference,
)

PAGE, HKV, HQ, D = 16, 3, 9, 64


def meta_for(tables: list[list[int]], seq_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, s, n in zip(tables, seq_lens, query_lens) for p in range(s - n, s)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_lens_host=query_lens, seq_lens_host=seq_lens,
        num_decodes=sum(1 for n in query_lens if n == 1), max_seq_len=max(seq_lens),
    )


def test_block_runs_group_consecutive_ids_and_count_tokens():
    assert block_runs([7, 8, 9, 3, 4, 20], 16 * 5 + 3, 16) == [(7, 3, 48), (3, 2, 32), (20, 1, 3)]
    assert block_runs([5, 6, 7, 0, 0], 33, 16) == [(5, 3, 33)]  # padding past the context is ignored


@pytest.mark.parametrize("runs", [1, 2, MAX_VIEW_RUNS])
def test_views_match_the_gathering_reference(runs):
    rng = random.Random(runs)
    torch.manual_seed(runs)
    k_cache = torch.randn(200, PAGE, HKV, D)
    v_cache = torch.randn_like(k_cache)
    tables, lens = [], []
    for _ in range(3):  # three decoding requests, each over `runs` runs with a partial last block
        blocks = []
        for _ in range(runs):
            start = rng.randrange(1, 180)
            blocks += [b for b in range(start, start + rng.randint(1, 6)) if b not in blocks]
        tables.append(blocks)
        lens.append((len(blocks) - 1) * PAGE + rng.randint(1, PAGE))
    meta = meta_for(tables, lens, [1, 1, 1])
    plan = decode_view_plan(meta, PAGE)
    assert plan is not None and max(len(p) for p in plan) <= runs
    q = torch.randn(3, HQ, D)
    ref = paged_attention_reference(q, LayerKV(k_cache, v_cache), meta, D**-0.5)
    out = decode_attention_views(q, LayerKV(k_cache, v_cache), plan, D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(TorchReferenceAttention().attend(q, LayerKV(k_cache, v_cache), meta, D**-0.5), ref, rtol=1e-5, atol=1e-5)


def test_fragmented_large_or_mixed_steps_use_the_reference():
    scattered = [list(range(1, 2 * (MAX_VIEW_RUNS + 1), 2))]  # every block its own run
    assert decode_view_plan(meta_for(scattered, [len(scattered[0]) * PAGE], [1]), PAGE) is None
    assert decode_view_plan(meta_for([[1]] * 5, [3] * 5, [1] * 5), PAGE) is None  # more than 4 decodes
    assert decode_view_plan(meta_for([[1], [2, 3]], [3, 20], [1, 7]), PAGE) is None  # a prefill chunk in the step


def scattered_table(rng: random.Random, runs: int, blocks: int) -> list[int]:
    """``blocks`` distinct block ids in ``runs`` runs of consecutive ids (the last may be longer)."""
    ids = rng.sample(range(1, 200, 20), runs)  # run starts 20 apart: runs never touch
    sizes = [blocks // runs] * (runs - 1) + [blocks - blocks // runs * (runs - 1)]
    return [start + j for start, size in zip(ids, sizes) for j in range(size)]


@pytest.mark.parametrize("runs,chunk", [(1, 30), (2, 7), (MAX_VIEW_RUNS, 17)])
def test_a_chunk_after_cached_context_through_views_matches_the_reference(runs, chunk):
    """A question after the cached documents (and a decode in the same step): its context read in
    place, its own keys causal, merged by log-sum-exp, as the gathering reference computes it;
    the chunk's tokens straddle a block boundary."""
    rng = random.Random(runs)
    torch.manual_seed(runs)
    k_cache, v_cache = torch.randn(220, PAGE, HKV, D), torch.randn(220, PAGE, HKV, D)
    context = 5 * PAGE + 9
    table = scattered_table(rng, runs, -(-(context + chunk) // PAGE))
    decode = [210, 211]
    tables, lens, qlens = [decode, table], [PAGE + 5, context + chunk], [1, chunk]
    plan = chunk_view_plan(meta_for(tables, lens, qlens), PAGE)
    assert list(plan) == [1] and len(plan[1][0]) <= runs
    q = torch.randn(1 + chunk, HQ, D)
    ref = paged_attention_reference(q, LayerKV(k_cache, v_cache), meta_for(tables, lens, qlens), D**-0.5)
    out = TorchReferenceAttention().attend(q, LayerKV(k_cache, v_cache), meta_for(tables, lens, qlens), D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    bf16 = TorchReferenceAttention().attend(q.bfloat16(), LayerKV(k_cache.bfloat16(), v_cache.bfloat16()), meta_for(tables, lens, qlens), D**-0.5)
    ref16 = paged_attention_reference(q.bfloat16(), LayerKV(k_cache.bfloat16(), v_cache.bfloat16()), meta_for(tables, lens, qlens), D**-0.5)
    torch.testing.assert_close(bf16.float(), ref16.float(), rtol=2e-2, atol=2e-2)


def test_chunks_without_context_or_with_fragmented_context_use_the_reference():
    whole = meta_for([[1, 2, 3]], [40], [40])  # a prompt's first chunk: no cached context
    assert chunk_view_plan(whole, PAGE) == {}
    scattered = list(range(1, 2 * (MAX_VIEW_RUNS + 2), 2))  # every block its own run
    assert chunk_view_plan(meta_for([scattered], [len(scattered) * PAGE], [5]), PAGE) == {}
