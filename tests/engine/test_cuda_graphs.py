"""The engine's CUDA graph paths against the same engine without them, on a GPU.

Collected only where CUDA is (conftest.py): on the CPU there is nothing to capture, and the
layout logic of these runners is tested there by test_greedy_invariance.py.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import generate_staggered

PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def staggered(model_dir, **options) -> tuple[list[list[int]], LLM]:
    """Four prompts arriving six steps apart, each chunked 16 tokens a step while the earlier
    ones decode: steps of decodes plus one chunk whose shapes repeat (the last prompt's with
    three decodes, padded to the graph bucket of four)."""
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, long_prefill_token_threshold=16, **options)
    rng = random.Random(0)
    prompts = [[rng.randrange(301) for _ in range(n)] for n in (40, 90, 130, 160)]
    tokens = generate_staggered(llm.core, prompts, PARAMS, steps_between=6)
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    return tokens, llm


TINY_MODELS = ["tiny_llama_dir", "tiny_qwen2_dir"]  # Qwen2: q|k|v biases in cuBLAS's and the GEMV's epilogues, captured


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_mixed_step_graphs_match_the_piecewise_path(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    reference, off = staggered(model_dir, mixed_cuda_graph_max_chunk=0)
    assert off.core.runner.mixed is None and off.core.step_times.piecewise_steps > 0
    got, llm = staggered(model_dir)
    mixed = llm.core.runner.mixed
    assert got == reference
    lazy = mixed.captures - mixed.start_captures
    assert lazy > 0 and llm.core.step_times.mixed_steps > lazy and mixed.padding_rows > 0 and mixed.padding_tokens > 0
    # what later captures add to the pool the start-up captures reserved (here nothing: they fit in it)
    assert dict(llm.core.memory_rows()).get("cuda_graphs (mixed steps, captured while serving)", 0) == mixed.pool_bytes >= 0


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_decode_graphs_match_the_eager_engine(fixture, request):
    """Decode graphs (packed inputs scattered in the graph, pending tokens read from the graph's
    argmax, padding rows) with async scheduling, against the engine with no graph at all."""
    model_dir = request.getfixturevalue(fixture)
    reference, _ = staggered(model_dir, enable_cuda_graphs=False)
    got, llm = staggered(model_dir)
    assert got == reference
    graphs = llm.core.runner.graphs
    assert llm.core.async_scheduling and llm.core.step_times.graph_steps > 0 and graphs.padding_rows > 0


def test_every_step_has_a_device_span_by_mode(tiny_llama_dir):
    """CUDA events around each step: spans for each mode the steps ran in, summing to about the
    steps' wall time (the device is busy or idle between them)."""
    import time

    llm = LLM(str(tiny_llama_dir), device="cuda", num_kv_blocks=256)
    t0 = time.perf_counter()
    llm.generate([[1, 2, 3, 4, 5] * 8, [7, 8, 9] * 5], PARAMS)
    wall = time.perf_counter() - t0
    st = llm.core.step_times
    summary = st.device_summary()
    assert sum(n for _, n in st.device_span.values()) == st.steps and {"graph", "piecewise"} <= set(st.device_span)
    assert 0 < summary["busy_s"] and summary["busy_s"] + summary["idle_s"] <= wall
    assert summary["by_mode"]["graph"]["ms_per_step"] > 0


def test_every_capture_holds_the_capture_lock(tiny_llama_dir):
    """The start-up captures and each mixed-step capture while serving hold the lock the process
    shares with its other GPU work (a speech model's batches), and nothing else takes it."""
    import threading

    from engine import EngineConfig
    from engine.engine_builder import build_engine

    class CountingLock:
        def __init__(self) -> None:
            self.lock, self.entries = threading.Lock(), 0

        def __enter__(self) -> None:
            self.lock.acquire()
            self.entries += 1

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    lock = CountingLock()
    core = build_engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_blocks=256,
                                     long_prefill_token_threshold=16), capture_lock=lock)  # fmt: skip
    mixed = core.runner.mixed
    assert mixed.start_captures == len(mixed.chunk_buckets) > 0  # every lone chunk, inside the start-up captures' one hold
    assert lock.entries == 1 + mixed.captures - mixed.start_captures  # then each warm-up mixed capture
    rng = random.Random(0)
    generate_staggered(core, [[rng.randrange(301) for _ in range(n)] for n in (40, 90, 130, 160)], PARAMS, steps_between=6)
    assert mixed.captures > mixed.start_captures and lock.entries == 1 + mixed.captures - mixed.start_captures


def test_verifying_steps_replay_row_graphs_like_the_eager_engine(tiny_llama_dir):
    """n-gram speculation on a GPU: verifying steps replay row graphs (a row per token, the
    non-fused RoPE + write, then decode attention over each row's own context) and give the eager
    engine's tokens; every KV block back."""
    rng = random.Random(1)
    prompts = [[rng.randrange(301) for _ in range(12)] * 4 for _ in range(3)]  # repeats: the n-gram lookup finds drafts
    options = dict(device="cuda", dtype="float32", num_kv_blocks=256, speculative="ngram", speculative_row_cost=0.0)
    reference = [o.token_ids for o in LLM(str(tiny_llama_dir), enable_cuda_graphs=False, **options).generate(prompts, PARAMS)]
    llm = LLM(str(tiny_llama_dir), **options)
    got = [o.token_ids for o in llm.generate(prompts, PARAMS)] + [llm.generate([p], PARAMS)[0].token_ids for p in prompts]
    assert got == reference * 2
    assert llm.core.spec_stats.num_drafts > 0 and llm.core.runner.row_graphs.padding_rows > 0
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
