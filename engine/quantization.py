"""Weight-only int4: run a GGUF file's own 4-bit weights on the CPU instead of dequantizing them.

Batch-1 decode on a CPU is bound by the bytes of weights read per token. A Q4_1 GGUF stores
~5 bits per weight; dequantized to float32 it is 32. PyTorch's CPU kernel
``aten._weight_int4pack_mm_for_cpu`` multiplies bf16 activations by packed 4-bit weights with
one (scale, zero) per group of 32 along K, exactly the Q4_1 layout:

    Q4_1:    w = d * q + m                      q in 0..15, d and m per block of 32
    kernel:  w = (q - 8) * scale + zero         so scale = d, zero = m + 8 d

Q8_0 (the tied embedding / LM head) is 8-bit, w = d * q with q in -128..127. Write
q = 16 * hi + lo (lo in 0..15, hi in -8..7): the head is the sum of two exact 4-bit matrices,
``16 d * hi`` and ``d * lo``, i.e. two int4 matmuls, still half the bytes of bf16.
Other GGUF types (Qwen2.5's Q4_K, Q5_0, Q6_K) arrive repacked as Q4_1 or Q8_0 by
engine/gguf_blocks.py; a fused q|k|v whose parts come in both formats runs as row segments.

On a CPU that multiplies bf16 in hardware (AMX or AVX512-BF16) the kernel wins only for a few
rows (decode); for a prefill chunk or a big batch the dense bf16 matmul is faster, so each
:class:`Int4Linear` keeps both and picks by row count (:func:`int4_max_rows`). On such a CPU the
dense copy is held in oneDNN's own blocked layout, made once at load: ``F.linear`` would lay the
weight out again on every call, which for a question's 30 rows costs as much as the multiply
itself. Without hardware bf16 matmuls torch emulates them and the kernel wins at every row count.
Scales and zeros are held in bf16 (the kernel's activation dtype): the GGUF's fp16 d and m are
rounded to 8 mantissa bits, a relative error of at most 2^-9 on each scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.gguf_blocks import GROUP, SUPPORTED, BlockCache, Blocks
from engine.gguf_file import GGUFFile, GGUFTensor, unpermute_rows

INT4_MAX_ROWS = 8  # at or below this many rows the int4 kernel beats dense bf16 on AMX CPUs
PREPACK_ROWS = 32  # the row count oneDNN lays a dense weight out for: a question after the cached documents
BF16_MATMUL_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo flags of hardware bf16 matmuls
PREPACK_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))  # oneDNN's bf16 reorder: either set


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def bf16_matmuls(flags: frozenset[str] | None) -> bool:
    """Whether a CPU with ``flags`` (:func:`cpu_flags`) multiplies bf16 in hardware; unknown flags
    count as yes (the dense path is then preferred above a few rows)."""
    return flags is None or bool(flags & BF16_MATMUL_FLAGS)


def int4_max_rows(flags: frozenset[str] | None) -> int:
    """Rows up to which :class:`Int4Linear` runs the int4 kernel on a CPU with ``flags``
    (:func:`cpu_flags`): :data:`INT4_MAX_ROWS` with hardware bf16 matmuls (or unknown flags),
    where dense bf16 wins above it; otherwise every row count. On a 2-core AVX-512 VNNI Xeon
    without them (2026-12-01) a [512, 576] x [576, 1536] product took 160-170 ms dense bf16 and
    87-94 ms int4, 2048 rows 610-680 ms and 300 ms."""
    return INT4_MAX_ROWS if bf16_matmuls(flags) else sys.maxsize


def can_prepack(flags: frozenset[str] | None) -> bool:
    """Whether this torch has oneDNN's prepacked bf16 linear (``mkldnn._linear_pointwise``) and a
    CPU with ``flags`` (:func:`cpu_flags`; unknown flags count as yes) that oneDNN lays a bf16
    weight out for: AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU refuses the reorder)."""
    cpu_ok = flags is None or any(needed <= flags for needed in PREPACK_FLAGS)
    return cpu_ok and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedInt4(nn.Module):
    """One int4 matrix [N, K] in the CPU kernel's packed layout, groups of 32 along K.

    The kernel packs rows in tiles of 16: N is padded with zero rows and the output sliced."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """``q`` int [N, K] in 0..15; ``scale``/``zero`` float [N, K/32]: w = (q - 8) * scale + zero."""
        super().__init__()
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"K={k} is not a multiple of the int4 group size {GROUP}")
        self.out_features = n
        pad = -n % 16
        q, scale, zero = q.to(torch.int32), scale.float(), zero.float()
        if pad:
            q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, zero))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        return out if out.shape[-1] == self.out_features else out[..., : self.out_features]


class Int4Linear(nn.Module):
    """A linear layer with int4 weights for small batches and dense bf16 for large ones.

    ``segments`` are row ranges of the output, concatenated: fused q|k|v or gate|up whose parts come
    in different formats (a Q4_1 q and a Q8_0 v) are one segment each. Each segment's ``parts`` are
    summed (one part for Q4_1, two for Q8_0's hi/lo split). ``bias`` (Qwen2's q|k|v) is added to
    either path's output. ``prepack`` holds the dense copy in oneDNN's layout (``packed``, no
    ``weight``; :meth:`dense_weight` gives it back as a plain tensor) where it is bf16."""

    def __init__(self, segments: list[list[PackedInt4]], dense: torch.Tensor, bias: torch.Tensor | None = None,
                 max_rows: int = INT4_MAX_ROWS, prepack: bool = False) -> None:
        super().__init__()
        self.segments = nn.ModuleList(nn.ModuleList(parts) for parts in segments)
        if prepack and dense.dtype == torch.bfloat16:  # one copy only: the plain one is dropped
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(dense, PREPACK_ROWS)
            except (RuntimeError, AttributeError) as e:  # oneDNN's own refusal (an AVX2-only CPU), or a torch without it
                raise ValueError("Int4Linear: prepack=True needs oneDNN's bf16 layout, which this CPU or torch lacks "
                                 f"(AVX-512 BW/VL/DQ or AVX-NE-CONVERT; see can_prepack); build it with prepack=False ({e})") from e
            self.register_buffer("packed", packed, persistent=False)
            self.register_parameter("weight", None)
        else:
            self.register_buffer("packed", None, persistent=False)
            self.weight = nn.Parameter(dense, requires_grad=False)  # same name as nn.Linear's: HF export, memory ledger
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.max_rows = max_rows

    def dense_weight(self) -> torch.Tensor:
        """The dense weight [N, K] as a plain tensor (copied out of oneDNN's layout when prepacked)."""
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows or x.dtype != torch.bfloat16:
            if self.packed is not None and x.dtype == torch.bfloat16:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return F.linear(x, self.dense_weight(), self.bias)
        outs = []
        for parts in self.segments:
            out = parts[0](x)
            for part in parts[1:]:
                out = out + part(x)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias


Int4Parts = list[tuple[np.ndarray, np.ndarray, np.ndarray]]
"""One matrix as int4 parts (q in 0..15, scale, zero), summed: one part for Q4_1, two for Q8_0."""


def int4_parts_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> Int4Parts:
    """Exact Q4_1 as one int4 matrix: scale = d, zero = m + 8 d."""
    return [(q, d, m + 8 * d)]


def int4_parts_q8_0(q: np.ndarray, d: np.ndarray) -> Int4Parts:
    """Exact Q8_0 as two int4 matrices: q = 16 hi + lo, w = (16 d) hi + d lo."""
    u = q.view(np.uint8)  # byte-wide arithmetic: a quarter of int32's memory traffic
    lo = u & 0x0F
    hi = (u >> 4) ^ 0x08  # the signed high nibble (-8..7) plus 8, i.e. its top bit flipped
    return [(hi, 16 * d, np.zeros_like(d)), (lo, d, 8 * d)]


def int4_parts(blocks: Blocks) -> Int4Parts:
    """Q4_1 or Q8_0 :class:`~engine.gguf_blocks.Blocks` as exact int4 parts."""
    return int4_parts_q4_1(blocks.q, blocks.d, blocks.m) if blocks.is_q4_1 else int4_parts_q8_0(blocks.q, blocks.d)


def pack(parts: Int4Parts) -> list[PackedInt4]:
    return [PackedInt4(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(s), torch.from_numpy(z))
            for q, s, z in parts]


def fuse_rows(matrices: list[Int4Parts]) -> list[Int4Parts]:
    """Fuse q|k|v or gate|up into row segments: neighbours with the same number of parts (both Q4_1
    or both Q8_0) are concatenated part by part (groups run along K) into one segment, one kernel
    call per part; a change of format starts the next segment."""
    segments: list[Int4Parts] = []
    for m in matrices:
        if segments and len(segments[-1]) == len(m):
            segments[-1] = [tuple(np.concatenate([a, b]) for a, b in zip(p, q)) for p, q in zip(segments[-1], m)]
        else:
            segments.append(m)
    return segments


# ---- from a GGUF file ---------------------------------------------------------------------------
def gguf_int4_parts(blocks: Blocks, unpermute_heads: int | None = None) -> Int4Parts:
    """The int4 parts of one GGUF matrix's :class:`~engine.gguf_blocks.Blocks` (any type
    :func:`~engine.gguf_blocks.tensor_blocks` reads: Q4_1, Q8_0, Q4_K, Q5_0, Q6_K); Q/K rows are
    un-permuted like the dense loader does for llama files."""

    parts = int4_parts(blocks)
    if unpermute_heads is not None:
        parts = [tuple(unpermute_rows(a, unpermute_heads) for a in p) for p in parts]
    return parts


def gguf_supports_int4(path: str) -> bool:
    """Whether every matrix of the GGUF file is of a type :func:`quantize_from_gguf` runs."""
    matrices = [t for t in gguf_tensors(path).values() if len(t.shape) == 2]
    return bool(matrices) and all(t.tensor_type in SUPPORTED for t in matrices)


def gguf_tensors(path: str) -> dict[str, GGUFTensor]:
    """The tensors of a GGUF file by name (memory-mapped views; see :mod:`engine.gguf_file`)."""
    return {t.name: t for t in GGUFFile.read(path).tensors}


def quantize_from_gguf(model: nn.Module, blocks: BlockCache, max_rows: int | None = None, prepack: bool | None = None) -> None:
    """Swap the model's projections (and LM head) for :class:`Int4Linear` built from the GGUF's
    own blocks (``blocks``: of the file the model's dense weights came from);
    ``max_rows`` None: :func:`int4_max_rows` of this CPU. ``prepack`` None: the layers' dense
    copies in oneDNN's layout wherever they are used (a row limit) and torch and the CPU have it. The head
    (run on one row a request) keeps its plain copy, which is the embedding table when tied."""
    max_rows = int4_max_rows(cpu_flags()) if max_rows is None else max_rows
    prepack = (max_rows != sys.maxsize and can_prepack(cpu_flags())) if prepack is None else prepack
    cfg = model.config
    tensors = blocks.tensors

    def parts(name: str, heads: int | None = None) -> Int4Parts:
        return gguf_int4_parts(blocks[name], heads)

    def swap(owner: nn.Module, attr: str, matrices: list[Int4Parts]) -> None:
        linear = getattr(owner, attr)  # an nn.Linear, or an Int4Linear when a quantized model is laid out again
        bias = None if linear.bias is None else linear.bias.data
        dense = linear.dense_weight() if isinstance(linear, Int4Linear) else linear.weight.data
        setattr(owner, attr, Int4Linear([pack(m) for m in fuse_rows(matrices)], dense, bias, max_rows, prepack))

    permuted = cfg.architecture == "llama"  # llama.cpp interleaves llama's Q/K rows, not qwen2's
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        swap(attn, "qkv_proj", [parts(b + "attn_q.weight", cfg.num_attention_heads if permuted else None),
                                parts(b + "attn_k.weight", cfg.num_key_value_heads if permuted else None), parts(b + "attn_v.weight")])
        swap(attn, "o_proj", [parts(b + "attn_output.weight")])
        swap(mlp, "gate_up_proj", [parts(b + "ffn_gate.weight"), parts(b + "ffn_up.weight")])
        swap(mlp, "down_proj", [parts(b + "ffn_down.weight")])
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    dense = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int4Linear([pack(parts(head))], dense.data, None, max_rows)
