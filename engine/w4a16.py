"""INT4 weights on CUDA (W4A16): a quarter of the bytes of bf16 for every projection of a layer.

Batch-1 decode reads every weight once a token, so bytes are its speed. Each projection of a layer
(q|k|v, o_proj, gate|up, down_proj) becomes a :class:`W4A16Linear`:

- the weight in groups of ``group`` (default 128) consecutive inputs of one output row, each group
  with an fp16 scale and minimum (w ~ q * scale + min, q in 0..15: GGUF's Q4_1 rule, asymmetric so
  that a group's range is used whole), two weights a byte: a group's first half in the low nibbles
  of its ``group / 2`` bytes, its second half in the high ones (as GGUF's 32-weight blocks);
- on CUDA, one-row steps (batch-1 decode) run the "pairs" GEMV (engine/kernels/int4_pairs_gemv.py,
  two weights an instruction) where GemvPolicy.int4_kernel says so (the default):
  :meth:`W4A16Linear.add_pairs` lays the groups out as its int32 words once at load;
- steps of up to TINYGEMM_MAX_ROWS rows (decode of a few requests) run PyTorch's own int4
  kernel (``aten._weight_int4pack_mm``, "tinygemm", the one gpt-fast uses):
  :meth:`W4A16Linear.add_tinygemm` lays the same groups out for it once at load, with a bf16
  scale and zero a group (the fp16 scale and minimum rounded to 8 mantissa bits, as on the CPU path);
- larger steps (bigger batches) multiply through this engine's Triton kernel
  (engine/kernels/int4_linear.py), which widens the nibbles to fp16 in registers, with the
  activations cast to fp16 (bf16 out). tinygemm is 2.3x faster at one row and slower from 8;
- steps of DEQUANTIZE_MIN_ROWS rows or more (prefill) write the weight out in bf16 once and
  multiply with cuBLAS: at 512 rows the Triton kernel took 4x cuBLAS's time on the bf16 weight
  (H200), and writing the weight out is one pass over it, small beside such a step's matmul.

Quantized at load from the model's bf16 weights (:func:`quantize_model_int4`), or, for a GGUF,
taken from the file's own 4-bit groups of 32 where a projection has them
(:func:`quantize_model_int4_from_gguf`; its other projections stay bf16). The embedding and the
norms stay bf16, and the lm_head too unless ``EngineConfig.lm_head_quantization`` asks for it in
groups of 128 (:func:`quantize_lm_head_int4`), as with FP8 (engine/fp8.py). On the CPU,
``quantization="int4"`` is a different path: the GGUF's own blocks (engine/quantization.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.fp8 import replace_projections
from engine.gguf_blocks import GROUP as BLOCK_GROUP
from engine.gguf_blocks import BlockCache
from engine.gguf_file import unpermute_rows

GROUP = 128


def quantize_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (K a multiple of ``group``, itself of 32) -> (qweight [N, K/2] uint8, scales, mins [N, K/group] fp16)
    with w ~ q * scale + min per group; the group's minimum and maximum are kept exactly up to fp16."""
    n, k = w.shape
    if k % group or group % 32:
        raise ValueError(f"int4 groups of {group} do not divide a weight of {k} inputs")
    g = w.float().reshape(n, k // group, group)
    low, high = g.amin(dim=2), g.amax(dim=2)
    scales = ((high - low) / 15).to(torch.float16)
    mins = low.to(torch.float16)
    step = scales.float().clamp(min=1e-12)[:, :, None]
    q = ((g - mins.float()[:, :, None]) / step).round().clamp(0, 15).to(torch.uint8)
    half = group // 2  # a group's first half in the low nibbles of its bytes, its second half in the high ones
    return (q[:, :, :half] | (q[:, :, half:] << 4)).reshape(n, k // 2), scales, mins


def unpack_groups(qweight: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The 4-bit values of a packed weight in input order, uint8 [N, K] in 0..15."""
    n = qweight.shape[0]
    packed = qweight.reshape(n, -1, group // 2)
    return torch.cat((packed & 0xF, packed >> 4), dim=2).reshape(n, -1)


def dequantize_groups(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The weight the kernel multiplies, in float32 [N, K]."""
    n = qweight.shape[0]
    q = unpack_groups(qweight, group).reshape(n, scales.shape[1], group).float()
    return (q * scales.float()[:, :, None] + mins.float()[:, :, None]).reshape(n, -1)


TINYGEMM_GROUPS = (32, 64, 128, 256)  # the group sizes aten._weight_int4pack_mm takes
TINYGEMM_MAX_ROWS = 4
"""Steps of up to this many rows run tinygemm where a projection has its layout (W4A16Linear.forward;
batch 1 follows GemvPolicy.int4_kernel): the 8B's projections on the H200 (2026-12-03 18:20 UTC,
engine/bench/experiments/fp8_gemv_sweep.py), tinygemm against the Triton kernel, us for q|k|v +
o_proj + gate|up + down_proj: 1 row 69 / 149, 2 rows 73 / 150, 4 rows 96 / 150, 8 rows 156 / 150,
16 rows 263 / 152."""
# CUDA steps of at least this many rows: the weight in bf16, then cuBLAS. Where a layer's four
# 8B projections cross (engine/bench/experiments/int4_large_step_ab.py, H100, 2026-12-06), us of
# the Triton kernel / write-out + cuBLAS: 64 rows 330 / 422, 128 rows 421 / 432, 256 rows
# 644 / 467 (o_proj and down_proj alone already favour the write-out at 64 rows; not used).
# int4 prefill of 8 x 2,048 tokens went from 12,971 to 41,163 tok/s.
DEQUANTIZE_MIN_ROWS = 128
TINYGEMM_INNER_K_TILES = 8  # 16-input tiles packed together: 8 gives the kernel 16-byte loads (gpt-fast's choice)


def tinygemm_operands(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int = GROUP
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups as ``aten._convert_weight_to_int4pack`` (CUDA) takes them: uint8 [N, K/2] with
    input 2j in the high nibble of byte j and 2j+1 in the low one, and the scales and zeros,
    bf16 [K/group, N, 2]. The kernel computes w = (q - 8) * scale + zero, so zero = min + 8 * scale."""
    q = unpack_groups(qweight, group)
    nibbles = (q[:, 0::2] << 4) | q[:, 1::2]
    zeros = mins.float() + 8 * scales.float()
    return nibbles.contiguous(), torch.stack((scales.float().t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()


def tinygemm_fits(n: int, k: int, group: int) -> bool:
    """Whether a weight [n, k] in groups of ``group`` fits the tinygemm layout (rows in tiles of 8,
    inputs in tiles of 16 x TINYGEMM_INNER_K_TILES)."""
    return group in TINYGEMM_GROUPS and n % 8 == 0 and k % (16 * TINYGEMM_INNER_K_TILES) == 0 and k % group == 0


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T of engine/kernels/int4_linear.py's kernel, in float32 from the dequantized weight (tests, CPU)."""
    y = x.float() @ dequantize_groups(qweight, scales, mins, group).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


class W4A16Linear(nn.Module):
    """y = x @ W^T (+ bias) with W in group-wise int4 (see the module doc)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int, bias: torch.Tensor | None) -> None:
        """The packed weight as :func:`quantize_groups` returns it (see :meth:`from_linear`)."""
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.mins = nn.Parameter(mins, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.in_features, self.out_features = qweight.shape[1] * 2, qweight.shape[0]
        self.tinygemm_weight: nn.Parameter | None = None  # with the scales and zeros below: after add_tinygemm
        self.tinygemm_scales_zeros: nn.Parameter | None = None
        self.pairs_words: nn.Parameter | None = None  # after add_pairs (the scales and minimums are shared)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: int = GROUP) -> "W4A16Linear":
        """``linear``'s weight quantized in groups of ``group``: an nn.Linear, or the nn.Embedding a
        tied head reads (no bias)."""
        bias = getattr(linear, "bias", None)
        return cls(*quantize_groups(linear.weight.detach(), group), group, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None, split_k: int = 1, pdl: bool = False,
                prefetch_k: int = 0, kernel: str = "auto", late_release: bool = False) -> torch.Tensor:
        """Any number of rows; one row through the "pairs" GEMV where ``kernel`` is "pairs" and the
        weight has that layout (:meth:`add_pairs`); tinygemm where the weight has its layout and
        ``kernel`` is "tinygemm" (any rows) or "auto" (up to TINYGEMM_MAX_ROWS rows), else the Triton kernel where it runs,
        its float32 reference elsewhere. ``split_k`` > 1 (x of two dims): float32 partials
        [split_k, rows, out] from the Triton kernel (engine/kernels/int4_linear.py) or the pairs GEMV.
        ``late_release`` (the pairs GEMV, with ``pdl``): the next kernel launches after its K loop."""
        from engine.kernels.int4_pairs_gemv import int4_pairs_gemv

        rows = x.reshape(-1, x.shape[-1])
        if kernel == "pairs" and self.has_pairs and rows.shape[0] == 1:
            y = int4_pairs_gemv(rows, self.pairs_words, self.scales, self.mins, self.group, self.bias, out_dtype, split_k=split_k,
                                pdl=pdl, prefetch_k=prefetch_k, late_release=late_release)
        else:
            y = self._multiply(rows, out_dtype, split_k, pdl, prefetch_k, kernel)
        return y if split_k > 1 else y.reshape(*x.shape[:-1], self.out_features)

    def _multiply(self, rows: torch.Tensor, out_dtype: torch.dtype | None, split_k: int, pdl: bool, prefetch_k: int,
                  kernel: str) -> torch.Tensor:
        """rows [M, K] @ W^T (+ bias) through tinygemm, the Triton kernel or its reference (see :meth:`forward`)."""
        from engine.kernels.int4_linear import int4_linear
        from engine.kernels.triton_utils import runs_triton

        if self.has_tinygemm and split_k == 1 and (kernel == "tinygemm" or (kernel == "auto" and rows.shape[0] <= TINYGEMM_MAX_ROWS)):
            return self.tinygemm(rows, out_dtype)
        if split_k == 1 and kernel == "auto" and rows.shape[0] >= DEQUANTIZE_MIN_ROWS and rows.is_cuda:
            return self.dequantized_matmul(rows, out_dtype)
        if runs_triton(rows):
            return int4_linear(rows, self.qweight, self.scales, self.mins, self.group, self.bias, out_dtype, split_k=split_k, pdl=pdl,
                               prefetch_k=prefetch_k)
        if split_k > 1:
            raise ValueError("W4A16Linear: split-K partials come from the Triton kernel (CUDA, or TRITON_INTERPRET=1)")
        return int4_linear_ref(rows, self.qweight, self.scales, self.mins, self.group, self.bias, out_dtype)

    def add_tinygemm(self) -> bool:
        """Lay the groups out for ``aten._weight_int4pack_mm`` as well (CUDA; :func:`tinygemm_operands`),
        kept beside the Triton kernel's copy, which prefill steps use; False where the shape does not fit."""
        if not tinygemm_fits(self.out_features, self.in_features, self.group):
            return False
        nibbles, scales_zeros = tinygemm_operands(self.qweight, self.scales, self.mins, self.group)
        self.tinygemm_weight = nn.Parameter(torch.ops.aten._convert_weight_to_int4pack(nibbles, TINYGEMM_INNER_K_TILES),
                                            requires_grad=False)
        self.tinygemm_scales_zeros = nn.Parameter(scales_zeros, requires_grad=False)
        return True

    @property
    def has_tinygemm(self) -> bool:
        return self.tinygemm_weight is not None

    def add_pairs(self) -> bool:
        """Lay the groups out as the "pairs" GEMV's int32 words as well (engine/kernels/int4_pairs_gemv.py,
        one-row steps; the scales and minimums are shared); False where the shape does not fit."""
        from engine.kernels.int4_pairs_gemv import pack_pairs, pairs_fit

        if not pairs_fit(self.out_features, self.in_features, self.group):
            return False
        self.pairs_words = nn.Parameter(pack_pairs(unpack_groups(self.qweight, self.group)), requires_grad=False)
        return True

    @property
    def has_pairs(self) -> bool:
        return self.pairs_words is not None

    def other_layouts(self) -> list[torch.Tensor]:
        """The tensors that lay the same groups out again for another kernel (tinygemm's, the pairs
        GEMV's): a step reads one layout, so byte counts of a step skip these."""
        return [t for t in (self.tinygemm_weight, self.tinygemm_scales_zeros, self.pairs_words) if t is not None]

    def tinygemm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [rows, K] @ W^T (+ bias) through ``aten._weight_int4pack_mm`` (after :meth:`add_tinygemm`);
        bf16 activations in, ``out_dtype`` (default x's) out."""
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.tinygemm_weight, self.group,
                                               self.tinygemm_scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(out_dtype or x.dtype)

    def dequantized_matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [rows, K] @ W^T (+ bias) with W written out in bf16 first (engine/kernels/int4_linear.py
        ``int4_dequantize``), then cuBLAS: for steps of many rows; ``out_dtype`` default x's."""
        from engine.kernels.int4_linear import int4_dequantize

        w = int4_dequantize(self.qweight, self.scales, self.mins, self.group)
        y = F.linear(x.to(torch.bfloat16), w, None if self.bias is None else self.bias.to(torch.bfloat16))
        return y.to(out_dtype or x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernel sees it, in float32 [N, K]."""
        return dequantize_groups(self.qweight, self.scales, self.mins, self.group)


def other_layout_bytes(model: nn.Module) -> int:
    """Bytes of the int4 projections' second and third layouts (:meth:`W4A16Linear.other_layouts`):
    the same groups again for tinygemm and the pairs GEMV, which the memory ledger shows apart."""
    from engine.memory import storage_bytes

    return storage_bytes([t for m in model.modules() if isinstance(m, W4A16Linear) for t in m.other_layouts()])


def quantize_model_int4(model: nn.Module, group: int = GROUP) -> int:
    """Every layer projection of ``model`` rounded into a :class:`W4A16Linear` of groups of
    ``group``; returns how many."""
    return replace_projections(model, lambda linear: W4A16Linear.from_linear(linear, group))


def quantize_lm_head_int4(model: nn.Module, group: int = GROUP) -> None:
    """The head of ``model`` (a LlamaForCausalLM) rounded into a :class:`W4A16Linear` of groups of
    ``group``: a tied head gets an int4 copy of its own (the bf16 table stays for the token
    lookups), an untied one is replaced. A GGUF's head is 6- or 8-bit (Q6_K, Q8_0): rounded again."""
    model.lm_head = W4A16Linear.from_linear(model.embed_tokens if model.lm_head is None else model.lm_head, group)


def quantize_model_int4_from_gguf(model: nn.Module, blocks: BlockCache) -> tuple[int, int]:
    """Replace each layer projection whose GGUF matrices are all 4-bit (Q4_1, or Q4_K, which
    engine/gguf_blocks.py repacks into Q4_1's groups of 32 exactly) by a :class:`W4A16Linear`
    holding the file's own groups: no second rounding. Projections with wider parts (Q5_0, Q6_K,
    Q8_0) keep their dense weights: re-rounding them to 4 bits is where a quantized model loses
    answers (engine/bench/experiments/quantization_quality.py). ``blocks``: of the file the model's
    dense weights came from. Returns (projections replaced, kept dense)."""

    cfg = model.config
    permuted = cfg.architecture == "llama"  # llama.cpp interleaves llama's Q/K rows, not qwen2's
    replaced = kept = 0
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        q_heads, k_heads = (cfg.num_attention_heads, cfg.num_key_value_heads) if permuted else (None, None)
        sources = {"self_attn.qkv_proj": [("attn_q", q_heads), ("attn_k", k_heads), ("attn_v", None)],
                   "self_attn.o_proj": [("attn_output", None)], "mlp.gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
                   "mlp.down_proj": [("ffn_down", None)]}
        for path, parts in sources.items():
            matrices = [(blocks[b + name + ".weight"], heads) for name, heads in parts]
            if not all(m.is_q4_1 for m, _ in matrices):
                kept += 1
                continue
            arrays = [[a if heads is None else unpermute_rows(a, heads) for a in (m.q, m.d, m.m)] for m, heads in matrices]
            q, d, m = (np.concatenate(column) for column in zip(*arrays))
            rows, cols = q.shape
            halves = q.reshape(rows, cols // BLOCK_GROUP, BLOCK_GROUP)
            packed = halves[:, :, :BLOCK_GROUP // 2] | (halves[:, :, BLOCK_GROUP // 2:] << 4)  # the file's own nibble order
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, name)
            device = linear.weight.device
            bias = None if linear.bias is None else linear.bias.detach()
            setattr(parent, name, W4A16Linear(torch.from_numpy(np.ascontiguousarray(packed.reshape(rows, cols // 2))).to(device),
                                              torch.from_numpy(d).to(device, torch.float16), torch.from_numpy(m).to(device, torch.float16),
                                              BLOCK_GROUP, bias))
            replaced += 1
    return replaced, kept
