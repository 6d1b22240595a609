"""FP8 weights (engine/fp8.py): the per-row e4m3 rounding, the W8A8 projection's arithmetic, a
model's projections replaced, the CPU's emulation, and the refusal on a GPU without FP8 tensor cores. The
CUDA matmul (``torch._scaled_mm``) and the FP8 GEMV run on the GPU (the GEMV also in Triton's
interpreter: test_triton_kernels.py); here the CPU runs the same arithmetic in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.bench.correctness import prompt_logits
from engine.config import ConfigError, EngineConfig
from engine.engine_builder import build_engine
from engine.fp8 import FP8_MAX, Fp8Linear, quantize_model_fp8, quantize_rows, weight_scale
from engine.loaded_model import LoadedModel


def test_each_row_maps_its_largest_magnitude_to_e4m3s_largest_and_rounds_within_its_grid():
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]  # rows 10,000x apart
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    err = (q.float() * scale[:, None] - w).abs()
    # e4m3 keeps 3 mantissa bits: at most half a step of 32 (the top binade, 256-448) of 448
    assert (err <= w.abs().amax(dim=1, keepdim=True) * 16 / FP8_MAX + 1e-12).all()
    assert quantize_rows(torch.zeros(2, 8))[0].float().abs().sum() == 0  # an all-zero row stays zero


def test_an_fp8_linear_rounds_weights_and_activations_per_row_and_keeps_its_bias():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    fp8 = Fp8Linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and weight_scale(fp8) is fp8.weight_scale and weight_scale(linear) is None
    x = torch.randn(7, 256)
    want = F.linear(x, linear.weight, linear.bias)
    got = fp8(x)
    assert got.shape == want.shape
    rel = (got - want).norm() / want.norm()
    assert 1e-3 < rel < 0.05  # rounded (not the float weight), but only by e4m3's few percent
    x3 = x.reshape(7, 1, 256)
    assert torch.equal(fp8(x3).reshape(7, 96), got)  # any leading shape


def test_a_models_projections_become_fp8_and_its_answers_stay_close(tiny_qwen2_dir):
    """The engine's CPU forward over its paged cache, before and after: every layer projection is
    an Fp8Linear (Qwen2's q|k|v bias kept), the embedding and head stay as they were, and the
    logits of a prompt move by e4m3's rounding only."""
    loaded = LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), device="cpu"))
    ids = torch.randint(0, loaded.model_config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    core = build_engine(EngineConfig(model=str(tiny_qwen2_dir), device="cpu"), loaded)
    before = prompt_logits(core, ids)
    model = loaded.model
    assert quantize_model_fp8(model) == 4 * loaded.model_config.num_hidden_layers
    layer = model.layers[0]
    assert all(isinstance(m, Fp8Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert layer.self_attn.qkv_proj.bias is not None
    assert model.embed_tokens.weight.dtype == torch.float32 and (model.lm_head is None or isinstance(model.lm_head, nn.Linear))
    after = prompt_logits(core, ids)
    assert not torch.equal(before, after)
    assert F.cosine_similarity(before, after, dim=-1).min() > 0.99


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(tiny_llama_dir, monkeypatch):
    """A pre-Ada GPU cannot run here: its answer to the capability check is faked (mocked), the rule is real."""
    from engine import loaded_model

    monkeypatch.setattr(loaded_model, "fp8_supported", lambda device: False)
    monkeypatch.setattr(loaded_model, "device_label", lambda device: "NVIDIA A100 (compute capability 8.0)")
    with pytest.raises(ConfigError, match=r"quantization='fp8' needs a CUDA GPU with FP8 tensor cores .*A100.*'int4'"):
        loaded_model.check_fp8_hardware(torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"lm_head_quantization='fp8' needs a CUDA GPU .*Use lm_head_quantization='none'"):
        loaded_model.check_fp8_hardware(torch.device("cuda"), "lm_head_quantization")
    loaded_model.check_fp8_hardware(torch.device("cpu"))  # the CPU emulates FP8
    with pytest.raises(ConfigError, match="bf16 activations"):
        EngineConfig(model=str(tiny_llama_dir), quantization="fp8", dtype="float32").validate()


def test_on_the_cpu_fp8_is_emulated_with_the_gpus_rounding(tiny_qwen2_dir):
    """``quantization="fp8"`` on the CPU: every projection an Fp8Linear, answers close to the dense
    model's and not equal to them (the rounding is real), as the eval measures it."""
    from engine import LLM, SamplingParams

    loaded = LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), device="cpu", quantization="fp8"))
    fp8 = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * loaded.model_config.num_hidden_layers and loaded.dtype == torch.bfloat16
    dense = LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), device="cpu", dtype="bfloat16"))
    ids = list(range(5, 40))
    rounded, plain = (prompt_logits(build_engine(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=16), m), ids) for m in (loaded, dense))
    assert not torch.equal(rounded, plain) and F.cosine_similarity(rounded, plain, dim=-1).min() > 0.99
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(LLM(str(tiny_qwen2_dir), loaded=loaded, num_kv_blocks=16).generate([ids], params)[0].token_ids) == 6


def test_the_hf_baseline_holds_the_weights_as_fp8_rounded_them(tiny_qwen2_dir):
    """engine.bench's HF model (its baseline and correctness reference) gets the dequantized FP8
    weights, split back into q/k/v and gate/up, not the raw e4m3 codes."""
    from engine.bench.hf_reference import to_hf_state_dict

    loaded = LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), device="cpu"))
    quantize_model_fp8(loaded.model)
    layer, cfg = loaded.model.layers[0], loaded.model_config
    state = to_hf_state_dict(loaded.model)
    q_rows = cfg.num_attention_heads * cfg.head_dim
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], layer.self_attn.qkv_proj.dequantized()[:q_rows])
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], layer.mlp.down_proj.dequantized())
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == loaded.model.embed_tokens.weight.dtype


def test_the_decode_ceiling_counts_the_fp8_bytes_a_step_reads(tiny_qwen2_dir):
    """engine.bench's bandwidth ceiling: an FP8 model's step reads its e4m3 weights, their scales,
    the rest as stored (norms, biases, the head), not the indexed embedding: fewer bytes than the
    same model in float32."""
    from engine.bench.ceilings import decode_step_bytes

    config = EngineConfig(model=str(tiny_qwen2_dir), device="cpu")
    loaded = LoadedModel.load(config)
    core = build_engine(config, loaded)
    dense = decode_step_bytes(core, 0)
    quantize_model_fp8(loaded.model)
    model = loaded.model
    want = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed_tokens.weight.numel() * 4
    assert model.lm_head is not None and decode_step_bytes(core, 0) == want < dense


@pytest.mark.parametrize("model_dir", ["tiny_qwen2_dir", "tiny_llama3_tied_dir"])
def test_an_fp8_lm_head_is_e4m3_and_the_ceiling_counts_it(model_dir, request):
    """``lm_head_quantization="fp8"`` with FP8 layers: the head becomes an Fp8Linear (an untied one replaced, a
    tied one copied: the bf16 table stays for the lookups), the logits move by its rounding only,
    a greedy answer still runs through it, the HF baseline holds the rounded head, and the
    bandwidth ceiling counts e4m3 head bytes (more tokens a second than with a bf16 head)."""
    from engine import LLM, SamplingParams
    from engine.bench.ceilings import decode_step_bytes
    from engine.bench.hf_reference import build_hf_model

    path = str(request.getfixturevalue(model_dir))
    ids = list(range(5, 40))
    runs = {}
    for head in (False, True):
        config = EngineConfig(model=path, device="cpu", quantization="fp8", lm_head_quantization="fp8" if head else "none", num_kv_blocks=16)
        loaded = LoadedModel.load(config)
        core = build_engine(config, loaded)
        runs[head] = loaded, prompt_logits(core, ids), decode_step_bytes(core, 0)
    (plain, plain_logits, plain_bytes), (rounded, rounded_logits, rounded_bytes) = runs[False], runs[True]
    head = rounded.model.lm_head
    assert isinstance(head, Fp8Linear) and head.weight.dtype == torch.float8_e4m3fn and head.bias is None
    assert not isinstance(plain.model.lm_head, Fp8Linear)
    table = rounded.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and head.weight.shape == table.shape
    assert not torch.equal(plain_logits, rounded_logits) and F.cosine_similarity(plain_logits, rounded_logits, dim=-1).min() > 0.99
    # a bf16 head of V x H became e4m3 (1 byte) plus one float32 scale a row
    vocab, hidden = table.shape
    assert plain_bytes - rounded_bytes == vocab * hidden * (2 - 1) - vocab * 4
    hf = build_hf_model(rounded.model)
    assert torch.equal(hf.lm_head.weight, head.dequantized().to(torch.bfloat16))
    assert torch.equal(hf.model.embed_tokens.weight, table)  # a tied table is not overwritten by the rounded head
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(LLM(path, loaded=rounded, num_kv_blocks=16).generate([ids], params)[0].token_ids) == 6


def test_a_head_format_is_checked_and_the_cpus_int4_keeps_its_own_head(tiny_qwen2_dir, llm_gguf_path, caplog):
    """An unknown head format, a float32 model (the quantized head runs bf16 activations) and the
    CPU's int4 path (whose head is the GGUF's own int4 already) are refused with the reason; an
    FP8 head on dense bf16 layers loads, with a warning that the CPU emulates it."""
    with pytest.raises(ConfigError, match="lm_head_quantization must be 'none', 'fp8' or 'int4', got 'int8'"):
        EngineConfig(model=str(tiny_qwen2_dir), lm_head_quantization="int8").validate()
    with pytest.raises(ConfigError, match="lm_head_quantization='fp8' runs bf16 activations; dtype 'float32'"):
        EngineConfig(model=str(tiny_qwen2_dir), lm_head_quantization="fp8", dtype="float32").validate()
    with pytest.raises(ConfigError, match="already runs the GGUF's own head as int4"):
        LoadedModel.load(EngineConfig(model=str(llm_gguf_path), device="cpu", quantization="int4", lm_head_quantization="fp8"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine"):
        loaded = LoadedModel.load(EngineConfig(model=str(tiny_qwen2_dir), device="cpu", lm_head_quantization="fp8"))
    assert "lm_head_quantization='fp8' on the CPU emulates" in caplog.text
    assert isinstance(loaded.model.lm_head, Fp8Linear) and loaded.dtype == torch.bfloat16
    assert not any(isinstance(m, Fp8Linear) for m in loaded.model.layers.modules())
