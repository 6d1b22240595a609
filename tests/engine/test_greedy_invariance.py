"""Greedy output does not depend on batching, chunking, prefix caching or preemption."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from engine import LLM, SamplingParams
from engine.execution_path import ExecutionPath
from tests.engine.helpers import generate_staggered, record_paths

SYSTEM = (
    "You are the handbook assistant of Northwind Robotics. Employees get 20 days of annual leave, "
    "request it with form HR-01 in PeopleHub, and give 10 working days' notice. Expenses are "
    "claimed within 30 days with form FIN-02."
)
QUESTIONS = ["How do I apply for annual leave?", "How long do I have to claim expenses?", "What is PeopleHub?", "Tell me a joke."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm):
    return [smollm.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm, llm_gguf_path, prompts):
    """Each prompt alone, whole-prompt prefill, no prefix cache."""
    llm = LLM(str(llm_gguf_path), loaded=smollm, enable_prefix_caching=False, enable_chunked_prefill=False, num_kv_blocks=64)
    return [llm.generate([p], PARAMS)[0].token_ids for p in prompts]


VARIANTS = {
    "batched": dict(),
    "chunk7": dict(long_prefill_token_threshold=7),
    "chunk64": dict(max_num_batched_tokens=64),
    "no-chunking": dict(enable_chunked_prefill=False),
    "prefix-off": dict(enable_prefix_caching=False),
    "tiny-pool-preemption": dict(num_kv_blocks=31, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False),
    "async": dict(async_scheduling="on"),
    "async-chunk7-tiny-pool-preemption": dict(async_scheduling="on", num_kv_blocks=31, block_size=4, long_prefill_token_threshold=7,
                                              enable_prefix_caching=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_variants_match_the_reference(variant, smollm, llm_gguf_path, prompts, reference):
    options = {"num_kv_blocks": 128, **VARIANTS[variant]}
    llm = LLM(str(llm_gguf_path), loaded=smollm, **options)
    results = llm.generate(prompts, PARAMS)
    assert [r.token_ids for r in results] == reference
    if variant.endswith("tiny-pool-preemption"):
        assert llm.stats().num_preemptions > 0  # the pool really forced recomputation
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_cache_hit_gives_the_same_output_as_the_miss(smollm, llm_gguf_path, prompts, reference):
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128)
    first = llm.generate(prompts[:1], PARAMS)[0]
    second = llm.generate(prompts[:1], PARAMS)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert first.token_ids == second.token_ids == reference[0]


def test_staggered_arrivals_change_nothing(smollm, llm_gguf_path, prompts, reference):
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, max_num_batched_tokens=48)
    assert generate_staggered(llm.core, prompts, PARAMS, steps_between=3) == reference


def test_piecewise_pieces_give_the_same_output(smollm, llm_gguf_path, prompts, reference):
    """The forward split at attention, with static buffers and padded token buckets (as CUDA
    graphs replay it on a GPU; here each piece reruns its function into the same outputs)."""
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, max_num_batched_tokens=40)
    llm.core.runner.capture_piecewise_graphs([8, 24, 40])
    paths = record_paths(llm.core.runner)
    results = llm.generate(prompts, PARAMS)
    assert [r.token_ids for r in results] == reference
    assert llm.core.step_times.piecewise_steps > 0 and paths[-1] is ExecutionPath.PIECEWISE
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_decode_graph_steps_give_the_same_output(async_scheduling, smollm, llm_gguf_path, prompts, reference):
    """Decode-only steps through CudaGraphRunner: packed on the host and scattered into the
    graph's buffers, padded to a bucket, greedy tokens from the step's own argmax; with async
    scheduling the pending input tokens come from that token buffer, or are copied in after a
    step that ran another way (prompts arrive while others decode). On a GPU each bucket is one
    CUDA graph; here the same scatter and argmax run eagerly."""
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, async_scheduling=async_scheduling)
    runner = llm.core.runner
    runner.capture_cuda_graphs([1, 2, 4], llm.core.max_model_len, llm.core.config.max_num_seqs)
    chained, engine_step = 0, llm.core.step  # chained: graph steps reading a graph step's pending tokens
    paths = record_paths(runner)

    def step():
        nonlocal chained
        pending = llm.core._inflight.device_tokens if llm.core._inflight else None
        outputs = engine_step()
        if paths and paths[-1] is ExecutionPath.GRAPH and pending is not None:
            chained += pending.tokens.data_ptr() == runner.graphs.tokens.data_ptr()
        return outputs

    llm.core.step = step
    assert generate_staggered(llm.core, prompts, PARAMS, steps_between=3) == reference
    assert llm.core.step_times.graph_steps > 0 and runner.graphs.padding_rows > 0  # 3 requests ran in the bucket of 4
    assert (chained > 0) == (async_scheduling == "on")
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


def test_decode_graph_steps_leave_sampled_and_penalized_rows_to_the_sampler(smollm, llm_gguf_path, prompts):
    """Seeded sampling, a repetition penalty and logprobs next to greedy rows in decode graph
    steps: the same tokens and logprobs as without the graphs (the graph's argmax is only taken
    for all-greedy, unpenalized batches)."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=10, ignore_eos=True)]
    results = {}
    for graphs in (False, True):
        llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, async_scheduling="on")
        if graphs:
            llm.core.runner.capture_cuda_graphs([1, 2, 4], llm.core.max_model_len, llm.core.config.max_num_seqs)
        results[graphs] = llm.generate(prompts[:3], params)
        assert (llm.core.step_times.graph_steps > 0) == graphs
    for with_graphs, without in zip(results[True], results[False]):
        assert with_graphs.token_ids == without.token_ids
        assert with_graphs.logprobs == without.logprobs


def test_mixed_step_graph_layout_gives_the_same_output(smollm, llm_gguf_path, prompts, reference):
    """Steps of decodes plus one prefill chunk through MixedGraphRunner: decode rows padded up to
    a bucket (null-block padding rows), the chunk after them padded up to its bucket (7 tokens to
    8, the last chunks' 1-6 tokens to 4 or 8), sampled rows mapped back. On a GPU each shape is
    one CUDA graph; here the same padded batch runs eagerly: the same tokens as unpadded."""
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128, long_prefill_token_threshold=7)
    llm.core.runner.enable_mixed_graphs([2, 4], max_chunk=8, max_model_len=llm.core.max_model_len, max_graphs=4,
                                        capture_lock=nullcontext(), chunk_buckets=[4, 8])
    # each prompt is chunked (7 tokens a step) while the earlier ones decode
    assert generate_staggered(llm.core, prompts, PARAMS, steps_between=12) == reference
    mixed = llm.core.runner.mixed
    assert llm.core.step_times.mixed_steps > 0 and mixed.padding_rows > 0 and mixed.padding_tokens > 0
    assert {(0, 8), (2, 8)} <= set(mixed.seen)  # a lone chunk; one or two decodes and a chunk
    assert {c for _, c in mixed.seen} <= {4, 8}
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total
