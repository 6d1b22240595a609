"""Host-side logic of the GPU path, tested on the CPU: graph buckets, split counts, prefill tiles."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from engine import ConfigError, EngineConfig, build_engine
from engine.attention.triton_paged import MAX_SPLITS, TARGET_PROGRAMS, decode_splits, prefill_splits, prefill_tiles
from engine.cuda_graph import graph_bucket
from engine.execution_path import ExecutionPath


def test_graph_bucket_is_the_smallest_that_fits():
    sizes = [1, 2, 4, 8, 16, 24, 32]
    assert graph_bucket(sizes, 1) == 1
    assert graph_bucket(sizes, 3) == 4
    assert graph_bucket(sizes, 17) == 24
    assert graph_bucket(sizes, 32) == 32
    assert graph_bucket(sizes, 33) is None  # runs eagerly


def test_decode_splits_fill_the_gpu_and_depend_only_on_the_batch_shape():
    assert decode_splits(1, 8) == MAX_SPLITS  # one request: spread its context
    assert decode_splits(256, 8) == 1  # many requests already fill the GPU
    for b in (1, 2, 4, 8, 16, 32):
        assert decode_splits(b, 8) * b * 8 >= min(TARGET_PROGRAMS, MAX_SPLITS * b * 8)


def test_prefill_splits_only_for_few_programs_over_long_contexts():
    assert prefill_splits(2, 32_000) > 1  # a short question after a long cached prefix
    assert prefill_splits(2, 100) == 1  # short context: nothing to spread
    assert prefill_splits(1024, 32_000) == 1  # a long chunk already has enough tiles
    assert prefill_splits(1, 10**6) <= MAX_SPLITS


def test_prefill_tiles_cover_every_query_head_row_once_heaviest_first():
    query_lens, seq_lens, group, block_m = [1, 1, 30, 70], [5, 9, 130, 70], 4, 64
    reqs, starts = prefill_tiles(query_lens, seq_lens, first=2, block_m=block_m, group=group)
    covered = {(r, s + i) for r, s in zip(reqs, starts) for i in range(block_m) if s + i < query_lens[r] * group}
    expected = {(r, m) for r in (2, 3) for m in range(query_lens[r] * group)}
    assert covered == expected
    assert len(set(zip(reqs, starts))) == len(reqs)  # no tile twice
    assert set(reqs) == {2, 3}  # decodes (the first two) are not prefill tiles
    # keys each tile attends: its request's cached context plus its queries up to the last row
    keys = [seq_lens[r] - query_lens[r] + min(query_lens[r], (s + block_m - 1) // group + 1) for r, s in zip(reqs, starts)]
    assert keys == sorted(keys, reverse=True)
    assert (reqs[0], starts[0]) == (2, 64)  # 100 cached + 30 queries outweighs the fresh 70's last tile


def test_triton_backend_on_the_cpu_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,'
        ' "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}'
    )
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_engine(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy", device="cpu",
                                attention_backend="triton", num_kv_blocks=8))
    if not torch.cuda.is_available():  # on a CUDA machine this configuration is valid
        with pytest.raises(ConfigError, match="CUDA is not available"):
            build_engine(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy", device="cuda", num_kv_blocks=8))


def test_every_per_step_tensor_starts_16_byte_aligned(tiny_llama_dir):
    """Triton compiles one kernel variant per alignment of its pointer arguments: views of the
    step's packed buffer at odd offsets made new variants compile in the middle of serving."""
    from engine import LLM, SamplingParams

    core = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4).core
    core.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    core.step()  # now a decode ...
    core.add_request([4, 5, 6, 7], SamplingParams(max_tokens=4))  # ... beside a 4-token prompt: 5 tokens, 2 requests
    sched = core.scheduler.schedule()
    inputs = core.runner.prepare(sched.chunks)
    meta = inputs.meta
    assert len(inputs.input_ids) == 5 and meta.num_requests == 2
    tensors = {"input_ids": inputs.input_ids, "positions": inputs.positions, "sample_rows": inputs.sample_rows,
               "slot_mapping": meta.slot_mapping, "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
               "block_tables": meta.block_tables}
    assert {name: t.data_ptr() % 16 for name, t in tensors.items()} == dict.fromkeys(tensors, 0)
    assert inputs.positions.tolist() == [3, 0, 1, 2, 3] and meta.seq_lens.tolist() == [4, 4]


def test_the_cpu_engine_never_launches_a_triton_kernel(tiny_llama_dir):
    """In a fresh process without Triton's interpreter (this test session may have it on, for the
    kernel tests): chunked prefill, so some steps sample no row and the lm_head gets 0 rows - a
    GEMV guard that let 0 rows through crashed every such CPU step."""
    import os
    import subprocess
    import sys

    code = (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, num_kv_blocks=64, block_size=4, max_num_batched_tokens=4)\n"
        "out = llm.generate([list(range(1, 12)), [7, 8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))\n"
        "print([len(o.token_ids) for o in out])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[3, 3]"


def test_the_decode_path_applies_to_steps_of_1_to_max_rows_tokens():
    from engine.kernels.gemv_policy import GemvPolicy

    assert not GemvPolicy().applies(1)  # the default is the plain (cuBLAS) path
    path = GemvPolicy(max_rows=1)
    assert path.applies(1) and not path.applies(0) and not path.applies(2)


def test_pdl_on_without_a_hopper_gpu_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ConfigError, match="pdl='on' needs the Triton batch-1 GEMVs on a CUDA device"):
        build_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8, pdl="on"))
    with pytest.raises(ConfigError, match="needs batch1_gemv=True"):
        EngineConfig(model=str(tiny_llama_dir), pdl="on", batch1_gemv=False).validate()
    with pytest.raises(ConfigError, match="pdl must be auto/on/off"):
        EngineConfig(model=str(tiny_llama_dir), pdl="yes").validate()
    core = build_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8))
    assert core.runner.gemv.max_rows == 0 and not core.runner.gemv.pdl  # auto: off on the CPU


def test_the_bench_varies_one_part_of_the_decode_path_at_a_time():
    from dataclasses import fields

    from engine.bench.latency import decode_path_variants
    from engine.kernels.gemv_policy import INT4_KERNELS, GemvPolicy

    path = GemvPolicy(max_rows=1, pdl=True)
    variants = decode_path_variants(path)
    assert variants["cuBLAS projections, separate SwiGLU"].max_rows == 0
    for name, variant in variants.items():
        if variant.max_rows:
            changed = [f.name for f in fields(GemvPolicy) if getattr(variant, f.name) != getattr(path, f.name)]
            assert len(changed) == 1, (name, changed)
    assert {v.pdl for v in variants.values() if v.max_rows} == {True, False}
    assert "same, PDL off" not in decode_path_variants(GemvPolicy(max_rows=1))
    releases = {v.late_release for v in variants.values() if v.max_rows}
    assert {(), path.late_release, ("qkv",)} <= releases  # none, the default, each projection alone
    assert {v.prefetch_bytes >> 20 for v in variants.values() if v.max_rows} == {0, 1, 4, 16, 64}
    assert {("qkv",), ("o",), ("qkv", "o")} <= {v.sum_tiles for v in variants.values()}
    for fp8, int4 in ((True, False), (False, True)):  # FP8 weights: also their math, tiles and down split; int4: its kernel
        quantized = decode_path_variants(path, fp8, int4)
        for name, variant in quantized.items():
            if variant.max_rows:
                changed = [f.name for f in fields(GemvPolicy) if getattr(variant, f.name) != getattr(path, f.name)]
                assert len(changed) <= 2, (name, changed)
        kinds = {v.int4_kernel for v in quantized.values()}
        assert kinds == (set(INT4_KERNELS) if int4 else {path.int4_kernel})
        assert ({v.fp8_down_split_k for v in quantized.values()} == {1, 2}) == fp8
        assert ({v.late_release for v in quantized.values()} >= {(), ("gate_up", "down")}) == int4  # pairs: its release


def test_the_decode_path_label_names_only_the_weights_own_choices():
    from engine.bench.latency import path_name
    from engine.kernels.gemv_policy import GemvPolicy

    path = GemvPolicy(max_rows=1, pdl=True)
    assert "FP8" not in path_name(path) and "int4" not in path_name(path)
    assert "FP8 math fp16 K 256" in path_name(path, fp8=True) and "down GEMV split-K 1" in path_name(path, fp8=True)
    int4 = path_name(path, int4=True)  # its o_proj and down_proj split by shape, not by the bf16 GEMV's numbers
    assert "int4 pairs" in int4 and "SwiGLU after gate|up" in int4 and "split-K" not in int4


def test_late_release_names_known_projections():
    from engine.kernels.gemv_policy import GemvPolicy

    with pytest.raises(ValueError, match="unknown projections \\['q_proj'\\]"):
        GemvPolicy(late_release=("q_proj",))
    with pytest.raises(ValueError, match="unknown projections \\['up'\\]"):
        GemvPolicy(prefetch_by_projection=(("up", 1),))


def test_a_projection_may_have_its_own_prefetch_budget():
    from engine.bench.latency import path_name
    from engine.kernels.gemv_policy import GemvPolicy

    path = GemvPolicy(max_rows=1, pdl=True, prefetch_bytes=1 << 20, prefetch_by_projection=(("gate_up", 4 << 20),))
    assert path.prefetch_budget("gate_up") == 4 << 20 and path.prefetch_budget("qkv") == 1 << 20
    assert "gate_up 4 MiB" in path_name(path)


def test_mixed_graph_settings_are_checked_and_bound_the_steps_taken(tiny_llama_dir):
    for bad in (dict(mixed_cuda_graph_max_chunk=-1), dict(mixed_cuda_graph_max_decodes=-2), dict(mixed_cuda_graph_max_graphs=-1),
                dict(mixed_cuda_graph_start_chunk=-1)):
        with pytest.raises(ConfigError, match="mixed_cuda_graph_max_chunk and _max_decodes must be >= 0"):
            EngineConfig(model=str(tiny_llama_dir), **bad).validate()
    from engine.attention import AttentionMetadata
    from engine.cuda_graph import MixedGraphRunner

    core = build_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8))
    runner = MixedGraphRunner(core.model, core.runner.backend, core.runner.kv_layers, [1, 2, 4], max_chunk=16,
                              max_blocks_per_seq=4, max_model_len=64, max_graphs=2, device=torch.device("cpu"),
                              gemv=core.runner.gemv, capture_lock=nullcontext(), chunk_buckets=[4, 8, 12])

    def meta(qlens):
        return AttentionMetadata(slot_mapping=None, query_start_loc=None, seq_lens=None, block_tables=None, query_lens_host=qlens,
                                 seq_lens_host=[q + 5 for q in qlens], num_decodes=sum(q == 1 for q in qlens), max_seq_len=0)

    assert runner.key(meta([1, 1, 1, 9]), 12) == (4, 12)  # three decodes pad to the bucket of four, 9 tokens to 12
    assert runner.key(meta([9]), 9) == (0, 12)  # a lone chunk
    assert runner.key(meta([3]), 3) == (0, 4) and runner.key(meta([13]), 13) == (0, 16)  # max_chunk is the last bucket
    assert runner.key(meta([1] * 5 + [9]), 14) is None  # more decodes than the largest bucket
    assert runner.key(meta([1, 17]), 18) is None  # a chunk longer than max_chunk
    assert runner.key(meta([1, 5, 9]), 15) is None  # two prefill chunks
    near_the_end = AttentionMetadata(slot_mapping=None, query_start_loc=None, seq_lens=None, block_tables=None,
                                     query_lens_host=[9], seq_lens_host=[62], num_decodes=0, max_seq_len=0)
    assert runner.key(near_the_end, 9) is None  # padded to 12 its context would be 65 tokens > max_model_len 64
    assert not runner.ready((4, 12)) and runner.ready((4, 12))  # captured the second time a shape is seen
    runner.graphs.update({(4, 12): None, (0, 12): None})  # max_graphs = 2 captured (on the CPU: no graph)
    assert runner.ready((4, 12)) and not runner.ready((2, 4)) and not runner.ready((2, 4))  # no third capture, no eviction
    runner.capture_at_start(8)  # on the CPU nothing is captured
    assert runner.start_captures == 0
    # start-up keys: every lone chunk, and every decode bucket's chunks up to the start chunk
    assert runner.start_keys(0) == [(0, 4), (0, 8), (0, 12), (0, 16)]
    assert runner.start_keys(8) == [(0, 4), (0, 8), (0, 12), (0, 16), (1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8)]
    runner.max_graphs = 0  # none while serving (the assistant's setting): a shape never becomes ready
    assert not runner.ready((1, 4)) and not runner.ready((1, 4)) and runner.ready((4, 12))


def test_device_summary_sums_spans_by_mode_and_idle_gaps():
    from engine.metrics import StepTimes

    st = StepTimes()
    st.record_device(ExecutionPath.GRAPH, 0.010, 0.0)
    st.record_device(ExecutionPath.GRAPH, 0.020, 0.001)
    st.record_device(ExecutionPath.PIECEWISE, 0.050, 0.002)
    st.record_device(ExecutionPath.GRAPH, 0.010, 0.0, read_back_idle=0.004)  # after a step read back at once
    s = st.device_summary()
    assert s["busy_s"] == pytest.approx(0.090) and s["idle_s"] == pytest.approx(0.003)
    assert s["read_back_idle_s"] == pytest.approx(0.004)
    assert s["by_mode"]["graph"] == {"s": pytest.approx(0.040), "ms_per_step": pytest.approx(40 / 3)}
    assert s["by_mode"]["piecewise"]["ms_per_step"] == pytest.approx(50.0) and set(s["by_mode"]) == {"graph", "piecewise"}
    from engine.bench.report import format_device_time

    assert "throughput  busy 0.09 s, idle 0.00 s, after read backs 0.00 s;  graph 0.04 s (13.33 ms/step)  piecewise 0.05 s (50.00 ms/step)" in format_device_time({"throughput": s})


def test_slowest_steps_rank_by_device_span_where_recorded():
    """With async scheduling a short step's host time includes waiting for the long step before
    it: the report ranks by device spans when there are any, by host time otherwise."""
    from engine.bench.report import slowest_steps
    from engine.metrics import StepTimes

    st = StepTimes()
    st.record(0.0, 0.0, 0.0, 0.0, 0.30, ExecutionPath.PIECEWISE, 1, 8192)
    st.record(0.0, 0.0, 0.0, 0.0, 0.45, ExecutionPath.MIXED, 1, 286)  # waited for the 8,192-token step
    assert slowest_steps(st) == "slowest steps by host time (s, requests, tokens): [(0.45, 1, 286), (0.3, 1, 8192)]"
    st.record_device(ExecutionPath.PIECEWISE, 0.32, 0.0, 1, 8192)
    st.record_device(ExecutionPath.MIXED, 0.021, 0.0, 1, 286)
    assert slowest_steps(st) == "slowest steps on the device (s, mode, requests, tokens): [(0.32, 'piecewise', 1, 8192), (0.021, 'mixed', 1, 286)]"


def test_execution_paths_keep_the_mode_names_of_metrics_and_bench_json():
    assert [p.value for p in ExecutionPath] == ["graph", "mixed", "piecewise", "native", "eager"]
    assert f"{ExecutionPath.MIXED}" == "mixed"


def test_narrow_models_take_down_proj_on_cublas_and_split_o_proj():
    """engine_builder.batch1_policy: the 1.5B shape (hidden 1,536) runs down_proj on cuBLAS and
    o_proj split-K 2 (faster there on the H200), the 8B shape the down GEMV unsplit o_proj."""
    from engine.config import ModelConfig
    from engine.engine_builder import batch1_policy
    from tests.conftest import REPO

    small = batch1_policy(ModelConfig.from_json(REPO / "engine/configs/qwen2.5-coder-1.5b.json"), pdl=True)
    large = batch1_policy(ModelConfig.from_json(REPO / "engine/configs/llama-3.1-8b.json"), pdl=True)
    assert (small.gemv_down, small.o_split_k, small.pdl, small.max_rows) == (False, 2, True, 1)
    assert (large.gemv_down, large.o_split_k) == (True, 1)

