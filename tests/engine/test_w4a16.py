"""INT4 weights for CUDA (engine/w4a16.py), the parts that run without a GPU: taking a GGUF's own
4-bit groups instead of rounding its dequantized weights a second time. The kernels' tests are in
test_triton_kernels.py (CUDA, or Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import EngineConfig
from engine.fp8 import PROJECTIONS
from engine.gguf_blocks import BlockCache
from engine.loaded_model import LoadedModel
from engine.quantization import gguf_tensors
from engine.kernels.gemv_policy import GemvPolicy
from engine.w4a16 import (W4A16Linear, int4_linear_ref, quantize_groups, quantize_model_int4_from_gguf, tinygemm_fits,
                          tinygemm_operands, unpack_groups)


def test_a_q4_1_gguf_becomes_int4_with_the_files_own_groups(llm_gguf_path):
    """SmolLM2 (llama, every projection Q4_1): all 4 x 30 projections become W4A16 with groups of
    32 whose weights are exactly the dense loader's (the file's fp16 scales and minimums kept as
    they are; llama's Q/K rows un-interleaved like the loader's), and a product through the
    layout equals the dense one."""
    loaded = LoadedModel.load(EngineConfig(model=str(llm_gguf_path), device="cpu", dtype="float32"))
    dense = {(i, p): layer.get_submodule(p).weight.detach().clone() for i, layer in enumerate(loaded.model.layers) for p in PROJECTIONS}
    replaced, kept = quantize_model_int4_from_gguf(loaded.model, BlockCache(gguf_tensors(str(llm_gguf_path))))
    assert (replaced, kept) == (4 * len(loaded.model.layers), 0)
    for (i, path), weight in dense.items():
        module = loaded.model.layers[i].get_submodule(path)
        assert isinstance(module, W4A16Linear) and module.group == 32
        assert torch.equal(module.dequantized(), weight), (i, path)
    x = torch.randn(3, dense[0, "mlp.down_proj"].shape[1])
    torch.testing.assert_close(loaded.model.layers[0].mlp.down_proj(x), F.linear(x, dense[0, "mlp.down_proj"]), rtol=1e-4, atol=1e-4)


def test_projections_with_wider_gguf_types_stay_dense(qwen_0_5b_gguf):
    """Qwen2.5-0.5B's first three layers: only layer 2's down_proj is Q4_K (repacked into groups
    of 32 exactly; its scales rounded to fp16), the rest Q5_0, Q6_K or Q8_0, which stay dense;
    Qwen2's q|k|v bias stays with its (dense) projection."""
    from dataclasses import replace

    from engine.loader import read_gguf
    from engine.model.llama import LlamaDecoderLayer

    config, _ = read_gguf(qwen_0_5b_gguf)
    config = replace(config, num_hidden_layers=3)

    class FirstLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(3))

    model = FirstLayers()
    blocks = BlockCache(gguf_tensors(str(qwen_0_5b_gguf)))
    assert quantize_model_int4_from_gguf(model, blocks) == (1, 11)
    down = model.layers[2].mlp.down_proj
    assert isinstance(down, W4A16Linear) and isinstance(model.layers[2].self_attn.qkv_proj, nn.Linear)
    assert model.layers[2].self_attn.qkv_proj.bias is not None
    want = blocks["blk.2.ffn_down.weight"].dequantize()
    got = down.dequantized().numpy()
    assert np.abs(got - want).max() <= 2**-10 * np.abs(want).max()


def test_tinygemm_operands_hold_the_same_weight():
    """The layout W4A16Linear.add_tinygemm hands PyTorch's int4 kernel: the scales and zeros
    (zero = min + 8 * scale, bf16, [groups, N, 2]) and the nibbles (input 2j high, 2j+1 low),
    read back into values and multiplied by the CPU build of the same kernel family
    (aten._weight_int4pack_mm_for_cpu, which takes the values unpacked), match the dequantized
    weight up to the bf16 rounding of the scales. The CUDA conversion itself runs in
    engine/bench/experiments/int4_kernel_ab.py and test_triton_kernels.py on a GPU."""
    torch.manual_seed(0)
    for group in (32, 128):
        w = torch.randn(48, 256) * 0.02
        q, scales, mins = quantize_groups(w, group)
        nibbles, scales_zeros = tinygemm_operands(q, scales, mins, group)
        assert nibbles.shape == (48, 128) and nibbles.dtype == torch.uint8 and scales_zeros.shape == (256 // group, 48, 2)
        values = torch.stack((nibbles >> 4, nibbles & 0xF), dim=-1).reshape(48, 256)
        assert torch.equal(values, unpack_groups(q, group))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
        x = torch.randn(3, 256).bfloat16()
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros).float()
        ref = int4_linear_ref(x, q, scales, mins, group, out_dtype=torch.float32)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, group


def test_tinygemm_takes_only_the_shapes_its_layout_has():
    assert tinygemm_fits(4096, 14336, 128) and tinygemm_fits(2048, 1536, 32)
    assert not tinygemm_fits(4100, 4096, 128)  # rows in tiles of 8
    assert not tinygemm_fits(4096, 4160, 32)  # inputs in tiles of 128
    assert not tinygemm_fits(4096, 4096, 512)  # a group size the kernel lacks
    linear = W4A16Linear(*quantize_groups(torch.randn(12, 256)), 128, None)
    assert not linear.add_tinygemm() and not linear.has_tinygemm


def test_the_pairs_layout_holds_the_same_nibbles_in_the_kernels_order():
    """pack_pairs: word i holds inputs 8i..8i+7, input 8i + 2p + h in bits 16h + 4p (checked bit by
    bit for one word), unpack_pairs reads the values back; W4A16Linear.add_pairs takes only shapes
    the kernel tiles."""
    from engine.kernels.int4_pairs_gemv import pack_pairs, unpack_pairs

    torch.manual_seed(0)
    for group in (32, 128):
        q, scales, mins = quantize_groups(torch.randn(32, 256), group)
        values = unpack_groups(q, group)
        words = pack_pairs(values)
        assert words.shape == (32, 32) and words.dtype == torch.int32
        assert torch.equal(unpack_pairs(words), values)
        word = int(words[3, 5]) & 0xFFFFFFFF
        assert all((word >> (16 * (j % 2) + 4 * (j // 2))) & 0xF == int(values[3, 40 + j]) for j in range(8))
    assert not W4A16Linear(*quantize_groups(torch.randn(24, 256)), 128, None).add_pairs()  # rows in tiles of 16
    linear = W4A16Linear(*quantize_groups(torch.randn(32, 256)), 128, None)
    assert linear.add_pairs() and linear.has_pairs
    assert linear.other_layouts() == [linear.pairs_words]


def test_the_pairs_gemv_splits_k_and_steps_through_whole_groups():
    """The 8B's shapes take their measured tiles (TUNED_TILES: o_proj unsplit, down_proj 7 slices,
    q|k|v 8 rows of 256-word steps), other shapes the general rule - pairs_split_k: 4 slices for a
    weight of 4096 rows and 4096 or 14336 inputs (whole 64-word steps), the 1.5B's o_proj 3 and
    down_proj 5 (enough programs, whole groups); pairs_tile: the largest step of whole groups that
    divides a slice, 16 words a thread (4 warps for 128-word steps, 2 for 64) - and an error where
    slices would cut a group. A tuned shape asked for another split takes the general rule."""
    from engine.kernels.int4_pairs_gemv import TUNED_TILES, PairsTile, pairs_split_k, pairs_tile

    assert (pairs_split_k(4096, 4096, 128), pairs_split_k(4096, 14336, 128)) == (1, 7)
    assert pairs_tile(6144, 4096, 128) == PairsTile(8, 256, 4, 1) == TUNED_TILES[(6144, 4096)][0]
    assert pairs_tile(4096, 14336, 128, 7) == PairsTile(16, 128, 4, 1)
    assert (pairs_split_k(2048, 4096, 128), pairs_split_k(2048, 14336, 128)) == (4, 4)  # the general rule
    assert (pairs_split_k(1536, 1536, 128), pairs_split_k(1536, 8960, 128)) == (3, 5)
    assert pairs_split_k(896, 896, 128) == 1
    assert (pairs_tile(2048, 4096, 128).block_w, pairs_tile(2048, 4096, 128).num_warps) == (128, 4)
    assert (pairs_tile(2048, 14336, 128, 4).block_w, pairs_tile(2048, 14336, 128, 4).num_warps) == (64, 2)
    assert pairs_tile(4096, 14336, 128, 4) == PairsTile(16, 64, 2, 3)  # the tuned shape, another split
    assert pairs_tile(1536, 8960, 128, 5).block_w == 32 and pairs_tile(64, 256, 32, 4).block_w == 8
    with pytest.raises(ValueError, match="whole groups"):
        pairs_tile(64, 256, 128, 4)


def test_the_pairs_gemv_compiles_for_hopper_with_bf16_pair_arithmetic(tmp_path, monkeypatch):
    """Triton's interpreter runs the pairs GEMV's float32 twin of its PTX; here the kernel with the
    PTX products (and PDL, a prefetch, the next kernel released early or late) compiles for sm_90 through ptxas (no GPU
    needed): nibble pairs made bf16 pairs by LOP3 and multiplied by bf16x2 FMAs, no per-weight
    conversion to float."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels._int4_pairs_triton import int4_pairs_gemv_kernel as kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled now, not found in a cache
    types = {"XP": "*i32", "QW": "*i32", "S": "*fp16", "MN": "*fp16", "Y": "*bf16", "B": "*i32"}
    for split in (1, 2):
        constexprs = {"GROUP": 128, "BLOCK_N": 16, "BLOCK_W": 128, "SPLIT_K": split, "HAS_BIAS": False, "USE_PDL": True,
                      "PREFETCH_W": 128, "USE_ASM": True, "LATE_RELEASE": split == 2}
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in inspect.signature(kernel.fn).parameters}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 3})
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "fma.rn.bf16x2" in ptx and "sub.rn.bf16x2" in ptx and "lop3.b32" in ptx
        assert "griddepcontrol.wait" in ptx and "prefetch.global.L2" in ptx and "griddepcontrol.launch_dependents" in ptx


def test_a_policy_names_a_known_int4_kernel():
    GemvPolicy(int4_kernel="tinygemm")
    GemvPolicy(int4_kernel="pairs")
    with pytest.raises(ValueError, match="int4_kernel"):
        GemvPolicy(int4_kernel="marlin")


def test_a_tied_head_rounded_into_int4_groups_gives_the_logits_of_its_rounded_weights(llm_gguf_path):
    """``lm_head_quantization="int4"`` (CUDA's path, its function run here on the CPU through the
    kernel's float32 reference): the tied SmolLM2 head gets an int4 copy of its own, the embedding
    table stays for the lookups, the next-token logits are those of a dense head holding the
    rounded weights, and the bandwidth ceiling counts the head's nibbles, scales and minimums
    instead of the bf16 table."""
    from engine.bench.ceilings import decode_step_bytes
    from engine.bench.correctness import prompt_logits
    from engine.engine_builder import build_engine
    from engine.w4a16 import quantize_lm_head_int4

    config = EngineConfig(model=str(llm_gguf_path), device="cpu", dtype="bfloat16", num_kv_blocks=16)
    loaded = LoadedModel.load(config)
    core = build_engine(config, loaded)
    ids = loaded.tokenizer.encode("Employees get twenty days of annual leave a year. To apply for leave, submit form HR-04 to your manager")
    dense = prompt_logits(core, ids)
    model = loaded.model
    assert model.lm_head is None
    quantize_lm_head_int4(model, group=64)  # SmolLM2's 576 inputs are 9 groups of 64 (the GPU's 128 needs K % 128)
    head = model.lm_head
    assert isinstance(head, W4A16Linear) and (head.out_features, head.in_features) == tuple(model.embed_tokens.weight.shape)
    rounded = prompt_logits(core, ids)
    # int4 moves a head's weights by ~10% (SmolLM2: groups of 64): close logits, not the same ones ...
    assert not torch.equal(dense, rounded) and F.cosine_similarity(dense, rounded, dim=-1).min() > 0.97
    # ... and exactly those of a dense head holding the rounded weights (up to bf16 products)
    dequantized = nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.bfloat16)
    dequantized.weight.data = head.dequantized().to(torch.bfloat16)
    model.lm_head = dequantized
    assert F.cosine_similarity(prompt_logits(core, ids), rounded, dim=-1).min() > 0.9999
    model.lm_head = head
    vocab, hidden = model.embed_tokens.weight.shape
    layers = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith(("embed_tokens", "lm_head")))
    assert decode_step_bytes(core, 0) == layers + vocab * hidden // 2 + 2 * vocab * (hidden // 64) * 2


def test_the_memory_ledger_shows_the_int4_groups_other_layouts_apart(llm_gguf_path):
    """A projection's groups held again for another kernel (here the pairs GEMV's words, made on
    the CPU too) are a ledger line of their own, not hidden in "weights": the two add up to every
    byte of the model."""
    from engine.engine_builder import INT4_LAYOUTS_OWNER, build_engine
    from engine.memory import tensor_bytes

    config = EngineConfig(model=str(llm_gguf_path), device="cpu", dtype="float32", num_kv_blocks=16)
    loaded = LoadedModel.load(config)
    quantize_model_int4_from_gguf(loaded.model, BlockCache(gguf_tensors(str(llm_gguf_path))))
    int4 = [m for m in loaded.model.modules() if isinstance(m, W4A16Linear)]
    assert sum(m.add_pairs() for m in int4) == len(int4)
    entries = build_engine(config, loaded).memory.entries
    words = sum(m.pairs_words.numel() * 4 for m in int4)
    assert entries[INT4_LAYOUTS_OWNER] == words > 0
    assert entries["weights"] + words == tensor_bytes(loaded.model)
