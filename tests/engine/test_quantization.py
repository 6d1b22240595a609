"""Weight-only int4 on the CPU: the GGUF's own Q4_1/Q8_0 blocks, packed for the int4 kernel.

The kernel is checked against float32 math on the dequantized blocks (the ``gguf`` package's
own dequantizer), on synthetic blocks and on the embedded model's real tensors; the engine in
int4 mode is checked against a float32 forward of the same file.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, LoadedModel
from engine.config import ConfigError
from engine.gguf_blocks import BlockCache, q4_1_blocks, q8_0_blocks, tensor_blocks
from engine.memory import tensor_bytes
from engine.quantization import (
    INT4_MAX_ROWS,
    Int4Linear,
    can_prepack,
    cpu_flags,
    fuse_rows,
    gguf_int4_parts,
    gguf_tensors,
    int4_max_rows,
    int4_parts,
    int4_parts_q4_1,
    int4_parts_q8_0,
    pack,
    quantize_from_gguf,
)
from engine.sampling import SamplingParams

Q = gguf.GGMLQuantizationType


def kernel_matmul(parts, x: torch.Tensor) -> torch.Tensor:
    return Int4Linear([pack(parts)], torch.zeros(0))(x).float()


def reference(w: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    return x.float() @ torch.from_numpy(np.asarray(w, dtype=np.float32)).t()


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 activations and output: a relative error of a few 2^-9 over the output's scale."""
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_synthetic_blocks_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 96)).astype(np.float32)  # odd row count, three groups along K
    raw = gguf.quants.quantize(w, qtype)
    exact = gguf.quants.dequantize(raw, qtype).reshape(40, 96)
    if qtype == Q.Q4_1:
        b = q4_1_blocks(raw, 40, 96)
        assert b.q.min() >= 0 and b.q.max() <= 15
        np.testing.assert_allclose(np.repeat(b.d, 32, 1) * b.q + np.repeat(b.m, 32, 1), exact, rtol=1e-6, atol=1e-6)
        parts = int4_parts_q4_1(b.q, b.d, b.m)
    else:
        b = q8_0_blocks(raw, 40, 96)
        np.testing.assert_allclose(np.repeat(b.d, 32, 1) * b.q, exact, rtol=1e-6, atol=1e-6)
        parts = int4_parts_q8_0(b.q, b.d)
        assert len(parts) == 2  # 16 hi + lo
        for qp, _, _ in parts:
            assert qp.min() >= 0 and qp.max() <= 15
    for rows in (1, 3):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert_close_bf16(kernel_matmul(parts, x), reference(exact, x))


@pytest.mark.parametrize("formats, segments", [((Q.Q4_1, Q.Q4_1, Q.Q4_1), 1), ((Q.Q4_1, Q.Q4_1, Q.Q8_0), 2),
                                               ((Q.Q8_0, Q.Q4_1, Q.Q8_0), 3)])
def test_fused_rows_are_the_row_concatenation(formats, segments):
    """q|k|v fused: one segment where the formats agree, row segments where they change (Qwen2.5
    1.5B: Q4_K q and k repacked to Q4_1, a Q6_K v to Q8_0); with the bias added."""
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal((n, 64)).astype(np.float32) for n in (24, 8, 8)]
    raws = [gguf.quants.quantize(w, f) for w, f in zip(mats, formats)]
    blocks = [(q4_1_blocks if f == Q.Q4_1 else q8_0_blocks)(r, w.shape[0], 64) for r, w, f in zip(raws, mats, formats)]
    fused = fuse_rows([int4_parts(b) for b in blocks])
    assert len(fused) == segments
    exact = np.concatenate([b.dequantize() for b in blocks])
    bias = torch.randn(40).to(torch.bfloat16)
    layer = Int4Linear([pack(s) for s in fused], torch.from_numpy(exact).to(torch.bfloat16), bias)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert_close_bf16(layer(x).float(), reference(exact, x) + bias.float())
    many = torch.randn(3, 64, dtype=torch.bfloat16)  # above max_rows: the dense weights, with the bias
    layer.max_rows = 2
    assert_close_bf16(layer(many).float(), reference(exact, many) + bias.float())


def test_real_tensors_of_the_embedded_model(llm_gguf_path):
    """One Q4_1 projection and the Q8_0 embedding / LM head of the shipped file."""
    tensors = gguf_tensors(str(llm_gguf_path))
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        cols, rows = (int(s) for s in t.shape)
        exact = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
        x = torch.randn(1, cols, dtype=torch.bfloat16)
        assert_close_bf16(kernel_matmul(gguf_int4_parts(tensor_blocks(t)), x), reference(exact, x))
    with pytest.raises(ValueError, match=re.escape(f"{llm_gguf_path.name}: tensor blk.0.attn_norm.weight is F32")):
        tensor_blocks(tensors["blk.0.attn_norm.weight"])


def test_int4_linear_uses_dense_weights_for_many_rows():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q4_1)
    exact = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_1).reshape(16, 64))
    layer = Int4Linear([pack(int4_parts(q4_1_blocks(raw, 16, 64)))], exact.to(torch.bfloat16), max_rows=4)
    dense = torch.zeros(16, 64, dtype=torch.bfloat16)  # a different dense copy shows which path ran
    layer.weight.data = dense
    small, big = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    assert layer(small).abs().sum() > 0  # int4 kernel
    assert layer(big).abs().sum() == 0  # dense path


def test_prepacking_asks_the_cpu_for_onednns_bf16_layout():
    """can_prepack: AVX-512 BW/VL/DQ or AVX-NE-CONVERT (or flags unknown); an AVX2-only CPU, no."""
    assert can_prepack(frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq"})) == can_prepack(None)
    assert can_prepack(frozenset({"avx2", "avx_ne_convert"})) == can_prepack(None)
    assert not can_prepack(frozenset({"avx2", "fma", "avx512bw"}))


def test_a_prepacked_dense_copy_is_the_dense_weight_in_onednn_layout():
    """Prepacked, the dense path multiplies by oneDNN's blocked copy (the plain one is dropped):
    the same products as ``F.linear`` on the plain weight (bias included), the weight given back
    exactly, its bytes in the memory ledger; few rows still take the int4 kernel. On a CPU oneDNN
    cannot lay bf16 out for (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT), asking for it is one clear error."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q4_1)
    blocks = q4_1_blocks(raw, 48, 64)
    exact = torch.from_numpy(blocks.dequantize()).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    if not can_prepack(cpu_flags()):
        with pytest.raises(ValueError, match="prepack=True needs oneDNN's bf16 layout"):
            Int4Linear([pack(int4_parts(blocks))], exact, bias, max_rows=4, prepack=True)
        return
    layer = Int4Linear([pack(int4_parts(blocks))], exact, bias, max_rows=4, prepack=True)
    assert layer.weight is None and layer.packed.is_mkldnn
    assert torch.equal(layer.dense_weight(), exact)
    assert tensor_bytes(layer) >= 48 * 64 * 2  # the packed copy counts
    for rows in (5, 30, 64):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        plain = torch.nn.functional.linear(x, exact, bias).float()
        assert (layer(x).float() - plain).abs().max() <= 2 ** -7 * plain.abs().max()
    zeroed = Int4Linear([pack(int4_parts(blocks))], torch.zeros(48, 64, dtype=torch.bfloat16), None, max_rows=4, prepack=True)
    small, big = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    assert zeroed(small).abs().sum() > 0 and zeroed(big).abs().sum() == 0  # int4 kernel, then the packed copy


def test_the_embedded_model_prepacked_gives_the_plain_model_s_answer(llm_gguf_path):
    """The whole model with its layers' dense copies prepacked: a 40-token prefill (dense path) and
    the greedy answer after it match the plain copies' (same weights, same products). A CPU oneDNN
    cannot lay bf16 out for refuses prepacking with one clear error."""
    path = str(llm_gguf_path)
    loaded = LoadedModel.load(EngineConfig(model=path, quantization="int4", max_model_len=512))
    if not can_prepack(cpu_flags()):
        with pytest.raises(ValueError, match="prepack=True needs oneDNN's bf16 layout"):
            quantize_from_gguf(loaded.model, BlockCache(gguf_tensors(path)), prepack=True)
        return
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow, "
                                                    "and say which one comes first when you read it from the top."}])  # fmt: skip
    assert len(prompt) > INT4_MAX_ROWS
    params, blocks = SamplingParams(temperature=0, max_tokens=12, logprobs=0), BlockCache(gguf_tensors(path))
    answers = []
    for prepack in (False, True):
        quantize_from_gguf(loaded.model, blocks, prepack=prepack)
        packed = [m for m in loaded.model.modules() if isinstance(m, Int4Linear) and m.packed is not None]
        assert len(packed) == (4 * len(loaded.model.layers) if prepack else 0)  # every projection, never the head
        answers.append(LLM(path, quantization="int4", max_model_len=512, native_decode_step="off", loaded=loaded).generate([prompt], params)[0])
    plain, ours = answers
    assert ours.token_ids == plain.token_ids
    chosen = [(a[t], b[t]) for a, b, t in zip(plain.logprobs, ours.logprobs, plain.token_ids)]
    assert max(abs(a - b) for a, b in chosen) < 0.05


def test_the_dense_path_is_kept_for_cpus_with_hardware_bf16_matmuls():
    """Dense bf16 wins past a few rows only where the CPU multiplies bf16 itself; elsewhere torch
    emulates it and the int4 kernel is faster at every row count."""
    assert int4_max_rows(frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})) == INT4_MAX_ROWS
    assert int4_max_rows(frozenset({"avx2", "avx512f", "avx512_bf16"})) == INT4_MAX_ROWS
    assert int4_max_rows(None) == INT4_MAX_ROWS  # flags unknown: as before
    no_bf16 = int4_max_rows(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert no_bf16 > 1 << 20


def test_engine_int4_tracks_the_float32_model(smollm_int4, smollm, smollm_hf, llm_gguf_path):
    """Greedy tokens of the int4 engine, scored by HF transformers in float32 on the dense weights
    of the same file: each chosen token's log-prob is close to what float32 gives it, and the
    answer is the float32 engine's answer. The question's float32 greedy tokens lead their runners-up
    by >= 0.4 nats: the plain "What is the capital of France?" starts on a 0.08-nat near-tie that
    bf16 rounding breaks either way depending on the CPU's matmul kernels (AMX or not)."""
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    out = LLM(str(llm_gguf_path), quantization="int4", max_model_len=512, loaded=smollm_int4).generate([prompt], params)[0]
    fp32 = LLM(str(llm_gguf_path), max_model_len=512, loaded=smollm).generate([prompt], params)[0]
    assert "Paris" in out.text and out.text == fp32.text
    hf = smollm_hf
    seq = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1 : -1].float(), -1)
    exact = logprobs[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
    assert (ours - exact).abs().max() < 0.3


def test_int4_needs_a_gguf_on_the_cpu(tiny_llama_dir, llm_gguf_path):
    with pytest.raises(ConfigError, match="on the CPU runs a GGUF's own 4-bit blocks: got hf weights"):
        LoadedModel.load(EngineConfig(model=str(tiny_llama_dir), quantization="int4", device="cpu"))
    with pytest.raises(ConfigError, match="bf16 activations"):
        EngineConfig(model=str(llm_gguf_path), quantization="int4", dtype="float32").validate()
    with pytest.raises(ConfigError, match="quantization must be"):
        EngineConfig(model=str(llm_gguf_path), quantization="int8").validate()
