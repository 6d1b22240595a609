"""``python -m engine.bench`` end to end on a tiny random model on the CPU: what runs on which
engine and what the report records (the figures themselves are for the GPU)."""

from __future__ import annotations

import json

import pytest

from engine.bench.cli import main


def test_throughput_runs_on_its_own_engine_with_its_own_batch_limit(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["latency", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--no-hf",
            "--throughput-max-num-seqs", "8", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["engines"] == {"main": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.5},
                                 "throughput": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.9}}
    assert set(record["memory"]) == {"engine of the other suites", "throughput engine"}
    results = record["results"]
    assert results["throughput_requests"] == 32 and results["throughput_output_tok_s"] > 0
    assert results["decode_bs1_tok_s"] > 0
    # 32 requests of >= 32 output tokens at most 8 at a time take >= 4 x 32 steps; the first
    # engine (32 at a time) would finish them in ~70.
    assert record["step_breakdown_ms"]["throughput"]["steps"] >= 4 * 32
    report = capsys.readouterr().out
    assert "# throughput engine: max_num_seqs 8" in report and "memory (throughput engine)" in report


def test_throughput_shares_the_engine_when_its_settings_are_the_same(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--no-hf", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["engines"]) == {"main"} and set(record["memory"]) == {"engine"}
    assert record["step_breakdown_ms"]["throughput"]["steps"] < 4 * 32


def test_every_suite_runs_and_the_record_holds_the_documented_fields(tmp_path):
    """All suites with the HF baseline on a tiny random model with long enough positions: the
    JSON record has every field docs/performance.md relies on."""
    from tests.engine.conftest import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=3, max_position_embeddings=4096)
    out = tmp_path / "bench.json"
    assert main(["--model", str(model), "--device", "cpu", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert {"device", "date", "command", "results", "versions", "memory", "step_breakdown_ms"} <= set(record)
    results = record["results"]
    for key in ("decode_bs1_tok_s", "decode_bs1_roofline_frac", "hf_decode_bs1_tok_s", "prefill_tok_s", "hf_prefill_tok_s",
                "throughput_output_tok_s", "prefix_ttft_p50_ms", "uncached_ttft_p50_ms", "chunked_itl_p99_ratio",
                "decode_scaling_1_tok_s", "decode_scaling_9_tok_s", "decode_scaling_32_tok_s"):
        assert results[key] > 0, key
    assert results["check_max_abs_logprob_diff"] <= max(2 * results["check_hf_same_dtype_diff"], 1e-3)
    assert set(record["step_breakdown_ms"]) == {"latency", "prefill", "throughput", "prefix", "chunked", "decode-scaling"}
    # The HF baseline's float32 weights are an owner in the engine's memory table (on a GPU
    # they would otherwise read as "other"), counted exactly.
    from engine.bench.correctness import HF_BASELINE_MEMORY
    from engine.config import ModelConfig

    params = ModelConfig.from_json(model / "config.json").num_parameters
    memory = record["memory"]["engine"] if "engine" in record["memory"] else record["memory"]["engine of the other suites"]
    assert 4 * params <= memory[HF_BASELINE_MEMORY] < 4.1 * params  # plus HF's RoPE buffers


def test_an_unknown_suite_is_a_clear_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["latncy", "--model", "unused", "--device", "cpu"])
    assert exit_info.value.code == 2 and "unknown suite(s) latncy" in capsys.readouterr().err


def test_the_model_is_required(capsys):
    """The engine knows no default model: the assistant's embedded one is passed explicitly."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["latency", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err


def test_the_decode_profile_batch_is_whole_when_profiled(tiny_llama_dir):
    """engine.bench.kernels' profiles: every requested stream still decoding after a prefill that
    took many steps (the first streams decode meanwhile), and through the profiled steps."""
    from engine.bench.kernels import decode_batch_engine

    steps = 4  # one prompt prefilled a step: the first stream decodes ~20 tokens before the last starts
    core = decode_batch_engine(str(tiny_llama_dir), 20, 40, steps=steps, budget=41, load_format="auto", device="cpu", num_kv_blocks=200)
    assert core.num_steps >= 20 + 3
    for _ in range(2 * steps):
        core.step()
    running = core.scheduler.running
    assert len(running) == 20 and all(not r.status.finished for r in running)


def test_exposed_time_counts_overlapped_kernels_once():
    """With PDL kernels overlap: each is charged with how far it moves the stream's end."""
    from engine.bench.kernels import exposed_time

    spans = [
        ("gemv", 0.0, 10.0),
        ("norm", 8.0, 12.0),  # starts in gemv's tail: charged 2, not 4
        ("gemv", 11.0, 20.0),  # charged 8
        ("tiny", 13.0, 15.0),  # ends inside the gemv before it: 0
        ("norm", 25.0, 27.0),  # after 5 idle
    ]
    exposed, idle = exposed_time(spans)
    assert exposed == {"gemv": 18.0, "norm": 4.0, "tiny": 0.0}
    assert idle == 5.0
    assert sum(exposed.values()) + idle == 27.0  # the stream's whole span


def test_each_kernel_of_a_decode_step_is_named_by_the_projection_it_ran():
    """projection_sites: matrix kernels between two decode attentions are o_proj, gate|up,
    down_proj, then the next layer's q|k|v; after a step's last layer the lm_head comes before the
    next step's first q|k|v; other kernels keep their names, and a matrix kernel beyond the order
    is "other matmul"; cuBLAS's split-K reduction counts with its projection. Two steps of a
    2-layer model, kernels named as on the H200."""
    from engine.bench.kernels import projection_sites

    def step(down: str) -> list[str]:
        head = ["Memcpy HtoD (Pinned -> Device)", "scatter_decode_inputs_kernel", "indexSelectSmallIndex", "add_rms_norm_kernel",
                "decode_linear_kernel"]
        layer = ["split_kv_decode_attention", "combine_kernel", "decode_linear_kernel", "add_rms_norm_kernel",
                 "decode_linear_kernel", down, "add_rms_norm_kernel"]
        return head + layer + ["decode_linear_kernel"] + layer + ["decode_linear_kernel", "chunk_argmax_kernel"]

    names = step("void gemvx::kernel<int, int, __nv_bfloat16>") + step("tinygemm_m16n8k16_chunk_kernel")
    sites = projection_sites(names, layers=2)
    matmuls = [site for name, site in zip(names, sites) if name != site]
    layer = ["o_proj", "gate|up", "down_proj"]
    assert matmuls == ["q|k|v", *layer, "q|k|v", *layer, "lm_head"] * 2
    assert sites[5:7] == ["split_kv_decode_attention", "combine_kernel"] and sites[-1] == "chunk_argmax_kernel"
    extra = projection_sites(["split_kv_decode_attention", *["int4_linear_kernel"] * 6], layers=4)
    assert extra[1:] == ["o_proj", "gate|up", "down_proj", "q|k|v", "other matmul", "other matmul"]
    reduce = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"  # cuBLAS's split-K down_proj: two kernels
    split = projection_sites(["split_kv_decode_attention", "decode_linear_kernel", "add_rms_norm_kernel", "decode_linear_kernel",
                              "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", reduce, "add_rms_norm_kernel", reduce], layers=4)
    assert split[4:] == ["down_proj", "down_proj", "add_rms_norm_kernel", reduce]  # a reduction after no projection keeps its name


def test_a_step_at_copy_bandwidth_caps_only_the_projections_slower_than_their_bytes():
    """step_at_copy_bandwidth: a projection slower than its bytes at the copy bandwidth counts at
    that time, a faster one (an lm_head helped by L2) as measured; the rest is added unchanged.
    The FP8 8B profile's figures (us a step): 2,256 us."""
    from engine.bench.kernels import step_at_copy_bandwidth

    fp8 = [(418.0, 200.6), (289.0, 133.8), (989.0, 936.3), (782.0, 467.8), (231.0, 261.5)]
    assert round(step_at_copy_bandwidth(fp8, 286.0)) == 2256
    assert step_at_copy_bandwidth([], 10.0) == 10.0


def test_a_projection_counts_the_bytes_a_one_row_step_reads():
    """projection_read_bytes: weight and bias of a bf16 projection; an int4 one's groups, scales
    and mins once, also when tinygemm's and the pairs GEMV's layouts of the same groups sit beside them."""
    import torch

    from engine.bench.kernels import projection_read_bytes
    from engine.w4a16 import W4A16Linear

    linear = torch.nn.Linear(256, 64).to(torch.bfloat16)
    assert projection_read_bytes(linear) == (256 * 64 + 64) * 2
    int4 = W4A16Linear.from_linear(torch.nn.Linear(256, 64, bias=False), 128)
    groups = 64 * 256 // 2 + 2 * 64 * 2 * 2  # nibbles, then fp16 scales and mins for 2 groups a row
    assert projection_read_bytes(int4) == groups
    # tinygemm's layout is made by a CUDA-only op: tensors of its sizes stand in for it here
    int4.tinygemm_weight = torch.nn.Parameter(torch.zeros(64 * 256 // 8, dtype=torch.int32), requires_grad=False)
    int4.tinygemm_scales_zeros = torch.nn.Parameter(torch.zeros(2, 64, 2, dtype=torch.bfloat16), requires_grad=False)
    assert projection_read_bytes(int4) == groups
    assert int4.add_pairs() and projection_read_bytes(int4) == groups  # the pairs GEMV's words: the same groups again


def test_throughput_bounds_count_flops_and_bytes_by_hand():
    """Two requests on a 1-layer shape, summed by hand: (prompt, output) (3, 1) decodes nothing;
    (2, 3) decodes 2 tokens over contexts of 3 and 4."""
    from engine.bench.ceilings import throughput_bounds
    from engine.config import ModelConfig

    mc = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4)
    b = throughput_bounds(mc, [(3, 1), (2, 3)], steps=4, weight_bytes=1000, kv_bytes_per_token=mc.kv_bytes_per_token(2), flops=1e3, bw=1e2)
    pair = 4 * 1 * 2 * 4  # FLOPs per (query, key): QK and PV, 2 heads of 4
    tokens = 3 + (2 + 2)  # prompts, plus the decoded tokens
    attention_pairs = 3 * 4 // 2 + 2 * 3 // 2 + (3 + 4)  # the two causal prefills, then the decodes' contexts
    assert b.flops == 2 * mc.num_parameters * tokens + pair * attention_pairs
    assert b.bytes == 4 * 1000 + (3 + 4) * mc.kv_bytes_per_token(2)
    assert b.compute_s == b.flops / 1e3 and b.memory_s == b.bytes / 1e2
    assert b.roofline_s == max(b.compute_s, b.memory_s) and b.serial_s == b.compute_s + b.memory_s
    # FP8 weights: the layer projections' FLOPs (2 a weight, each of the 7 tokens) at their own rate
    fp8 = throughput_bounds(mc, [(3, 1), (2, 3)], steps=4, weight_bytes=500, kv_bytes_per_token=9, flops=1e3, bw=1e2,
                            projection_flops=4e3)
    projections = 2 * mc.num_projection_parameters * tokens
    assert fp8.compute_s == pytest.approx((b.flops - projections) / 1e3 + projections / 4e3) and fp8.compute_s < b.compute_s
    assert fp8.bytes == 4 * 500 + (3 + 4) * 9
    assert mc.num_projection_parameters == 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # q|k|v, o, gate|up + down


def test_fp8_weights_are_priced_at_the_fp8_matmuls_own_rate(tiny_qwen2_dir):
    """The FP8 matmul rate is measured with the call Fp8Linear makes (``torch._scaled_mm`` runs on
    the CPU too, small); a run prices its projections at it only where they are FP8 on a GPU."""
    import torch

    from engine import EngineConfig, LoadedModel, build_engine
    from engine.bench.ceilings import fp8_matmul_flops, projection_rate

    assert fp8_matmul_flops(torch.device("cpu"), n=128) > 0
    for quantization in ("none", "fp8"):  # the CPU emulates FP8 in float32: the dense rate stands
        core = build_engine(EngineConfig(model=str(tiny_qwen2_dir), quantization=quantization, num_kv_blocks=8),
                            LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), quantization=quantization)))
        assert projection_rate(core, 123.0) == 123.0


def test_the_throughput_suite_prints_its_roofline_and_serial_bound(tiny_llama_dir, tmp_path, capsys):
    """The throughput figure against bounds from the same run's matmul and copy bandwidth: the
    roofline (compute and bytes overlapped) is never beaten, the serial bound lies below it."""
    out = tmp_path / "bench.json"
    assert main(["throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--no-hf", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    tput, roof, serial = results["throughput_output_tok_s"], results["throughput_roofline_tok_s"], results["throughput_serial_bound_tok_s"]
    assert 0 < tput < roof and serial <= roof
    assert results["throughput_compute_s"] > 0 and results["throughput_memory_s"] > 0
    report = capsys.readouterr().out
    assert "roofline: " in report and "the same one after the other (no overlap)" in report


def test_a_quantized_run_names_its_headline_figures_by_the_weights_format():
    """``decode_bs1_fp8_tok_s`` and siblings: runs of several formats merge into one results
    object; a dense run adds none."""
    from engine.bench.cli import Format, quantized_keys

    results = {"decode_bs1_tok_s": 310.7, "prefill_tok_s": 41587.1, "decode_bs1_graph_ms": 3.2}
    assert quantized_keys(results, Format("fp8")) == {"decode_bs1_fp8_tok_s": 310.7, "prefill_fp8_tok_s": 41587.1}
    assert quantized_keys({"throughput_output_tok_s": 1.0}, Format("int4")) == {"throughput_int4_output_tok_s": 1.0}
    assert quantized_keys(results, Format("none")) == {}


def test_a_run_with_an_fp8_kv_cache_names_its_figures_by_both_formats():
    """FP8 weights and an FP8 KV cache: ``throughput_fp8_kv_output_tok_s``, apart from FP8 weights
    alone; other weights keep their name before ``fp8_kv``."""
    from engine.bench.cli import Format, quantized_keys

    tput = {"throughput_output_tok_s": 9000.0}
    assert quantized_keys(tput, Format("fp8", "fp8")) == {"throughput_fp8_kv_output_tok_s": 9000.0}
    assert quantized_keys(tput, Format("fp8", "auto")) == {"throughput_fp8_output_tok_s": 9000.0}
    assert quantized_keys(tput, Format("int4", "fp8")) == {"throughput_int4_fp8_kv_output_tok_s": 9000.0}
    assert quantized_keys(tput, Format("none", "fp8")) == {"throughput_dense_fp8_kv_output_tok_s": 9000.0}


def test_a_setting_the_machine_cannot_run_is_one_line_not_a_traceback(tiny_llama_dir):
    """``python -m engine.bench ... --pdl on`` on a CPU: the engine's reason, exit 1."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "engine.bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu",
                           "--pdl", "on", "--no-hf"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "error: pdl='on' needs the Triton batch-1 GEMVs on a CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_one_run_compares_formats_each_against_its_own_ceiling(tiny_qwen2_dir, tmp_path, capsys):
    """``--formats none fp8 none+fp8-kv`` (the CPU emulates FP8 weights; its torch backend reads an
    FP8 cache): each format's suites run in one process, the comparison prints each figure against
    the first format and against its own ceiling, and the results merge under each format's names."""
    out = tmp_path / "formats.json"
    assert main(["latency", "throughput", "--model", str(tiny_qwen2_dir), "--device", "cpu", "--no-hf",
                 "--formats", "none", "fp8", "none+fp8-kv", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## format fp8" in text and "## formats against the first (bf16), each against its own ceiling" in text
    assert "decode batch 1, fp8" in text and "its own ceiling (bf16 + fp8 KV)" in text
    record = json.loads(out.read_text())
    results = record["results"]
    for key in ("decode_bs1_tok_s", "decode_bs1_fp8_tok_s", "decode_bs1_dense_fp8_kv_tok_s", "throughput_fp8_output_tok_s",
                "throughput_dense_fp8_kv_output_tok_s"):
        assert results[key] > 0, key
    assert results["decode_bs1_fp8_speedup"] == pytest.approx(results["decode_bs1_fp8_tok_s"] / results["decode_bs1_tok_s"])
    # each ceiling counts its own format's bytes: e4m3 weights, or e4m3 K/V with their scales
    formats = record["formats"]
    assert sorted(formats) == ["bf16", "bf16 + fp8 KV", "fp8"]
    ceilings = {name: f["results"]["decode_bs1_ceiling_tok_s"] / f["results"]["copy_bandwidth_gbs"] for name, f in formats.items()}
    assert ceilings["fp8"] > ceilings["bf16"] and ceilings["bf16 + fp8 KV"] > ceilings["bf16"]
    assert results["decode_bs1_ceiling_fp8_tok_s"] == formats["fp8"]["results"]["decode_bs1_ceiling_tok_s"]


def test_a_format_with_a_quantized_head_has_its_own_name_and_keys():
    """``int4+fp8-head`` (EngineConfig.lm_head_quantization) runs beside ``int4`` in one comparison,
    so its figures need names of their own; the extras come in any order."""
    from engine.bench.cli import Format, quantized_keys

    assert Format.parse("fp8+fp8-head") == Format("fp8", "auto", "fp8")
    assert Format.parse("int4+fp8-kv+int4-head") == Format("int4", "fp8", "int4") and Format.parse("bf16") == Format()
    assert Format.parse("int4+fp8-head+fp8-kv").name == "int4 + fp8 head + fp8 KV"
    assert quantized_keys({"decode_bs1_tok_s": 1.0}, Format.parse("int4+fp8-head")) == {"decode_bs1_int4_fp8_head_tok_s": 1.0}
    assert Format.parse("none+fp8-head").label == "dense_fp8_head" and Format.parse("fp8+fp8-kv").label == "fp8_kv"


@pytest.mark.parametrize("argv, message", [(["--formats", "fp9"], "unknown format 'fp9'"),
                                           (["--formats", "fp8+head"], "unknown format 'fp8+head'"),
                                           (["--formats", "int4+fp8-head+int4-head"], "unknown format 'int4+fp8-head+int4-head'"),
                                           (["--formats", "fp8", "--lm-head-quantization", "fp8"], "leave out --quantization, --lm-head"),
                                           (["--formats", "none", "--quantization", "fp8"], "leave out --quantization")])
def test_a_bad_format_list_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["latency", "--model", "x.json", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_decode_profile_too_large_for_the_kv_cache_says_so(tiny_llama_dir):
    """A batch whose K/V cannot all fit is preempted in set-up: the error names the cache's blocks
    against what the batch needs and what to change, not only how many requests were left."""
    from engine.bench.kernels import decode_batch_engine

    with pytest.raises(RuntimeError, match=r"3 of 6 requests still running; the KV cache holds 13 blocks of 16 tokens and the "
                                           r"batch needs 24: profile a smaller --batch or --context"):
        decode_batch_engine(str(tiny_llama_dir), 6, 40, steps=2, budget=41, load_format="auto", device="cpu", num_kv_blocks=14)


def test_decode_cases_rotate_copies_past_the_cache_in_both_cache_dtypes():
    """decode_cases: enough copies of one decode batch for ``total_bytes`` of bf16 K/V, the same
    copies in e4m3 with per-row scales, and each copy's minimum bytes (FP8: half, plus a float32
    scale a row)."""
    import torch

    from engine.bench.kernels import D, HKV, PAGE, attention_cost, decode_cases

    cases = decode_cases(3, 40, torch.device("cpu"), total_bytes=1_000_000)
    _, nbytes = attention_cost([1] * 3, [40] * 3)
    assert cases.bf16_bytes == nbytes and len(cases.bf16) == len(cases.fp8) == -(-1_000_000 // nbytes) > 1
    assert cases.fp8_bytes == nbytes / 2 + nbytes / 2 / D * 4 / 2
    (q, bf16, meta), (q8, fp8, meta8) = cases.bf16[0], cases.fp8[0]
    assert q8 is q and meta8 is meta and fp8.quantized and not bf16.quantized
    assert fp8.k.shape == bf16.k.shape and fp8.k_scale.shape == bf16.k.shape[:3] and bf16.k.shape[1:] == (PAGE, HKV, D)
    torch.testing.assert_close(fp8.dequantized(torch.float32).v, bf16.v.float(), rtol=0.07, atol=1e-2)
    assert not torch.equal(cases.bf16[0][1].k, cases.bf16[1][1].k)  # each copy its own context
    # lengths and block tables in int32, as the engine passes them: a kernel timed here compiles as it runs
    assert meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    from engine.attention.torch_ref import paged_attention_reference

    assert paged_attention_reference(q, fp8.dequantized(torch.bfloat16), meta, D**-0.5).isfinite().all()
