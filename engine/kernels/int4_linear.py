"""Projections with group-wise int4 weights on CUDA (W4A16): one Triton kernel for every step size.

``int4_linear(x, ...)`` computes x @ W^T for the layout of engine/w4a16.py: steps of at most 16
rows (decode) take one 16-row M tile and weight tiles of few rows, so that every SM gets programs
(and, for o_proj and down_proj, split-K partials that the next norm sums); larger steps (prefill)
take 64 x 64 tiles. The weight's nibbles are widened in registers, never written out as bf16.
``int4_dequantize`` writes a weight out whole instead, for steps so large (prefill) that cuBLAS on
the bf16 weight beats widening in the kernel by more than the extra pass costs (engine/w4a16.py
``DEQUANTIZE_MIN_ROWS``).
A one-row GEMV on the CUDA cores (``Int4Tile(kind="sum")``, int4_gemv_kernel) is there for the
sweep to weigh against the tensor-core tiles at batch 1; not measured yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE_ROWS = 16  # a step of up to this many rows takes one M tile
TARGET_PROGRAMS = 264  # about two waves on the H200's 132 SMs


@dataclass(frozen=True)
class Int4Tile:
    block_m: int
    block_n: int
    groups_per_step: int
    num_warps: int
    num_stages: int
    kind: str = "dot"
    """"dot": tensor cores, x padded to block_m rows; "sum": one row of x on the CUDA cores
    (int4_gemv_kernel; groups_per_step and block_m unused)."""


def int4_tile(rows: int, n: int, k: int, group: int, split_k: int = 1) -> Int4Tile:
    """The tile for x [rows, k] @ W [n, k]^T. At batch 1: 32 weight rows a program, 3 stages, and
    one group a loop step for a split weight, four (or as many as the slice allows) for an unsplit
    one: the fastest of 18 tiles a shape in isolation on the H200 (2026-12-03, weights rotating
    through more than L2; engine/bench/experiments/int4_tile_sweep.py): 8B q|k|v 22.5 us, o_proj
    (split 4) 15.3, gate|up 61.2, down_proj (split 4) 49.0; 1.5B down_proj (split 2) 22.2."""
    slice_groups = k // split_k // group
    if rows <= DECODE_ROWS:
        return Int4Tile(16, 32, 1 if split_k > 1 else next(s for s in (4, 2, 1) if slice_groups % s == 0), 4, 3)
    # prefill: at most two groups a step (the tile as it ran on the H200); four 64-row x tiles of
    # 128 fp16 inputs in 3 stages would pass the SM's shared memory
    return Int4Tile(64, 64, 2 if slice_groups % 2 == 0 else 1, 4, 3)


def int4_split_k(rows: int, n: int, k: int, group: int) -> int:
    """K slices for a decode step's o_proj or down_proj (their partials are summed by the next norm):
    doubled while the grid stays under two waves (TARGET_PROGRAMS x 2) and each slice holds whole groups."""
    if rows > DECODE_ROWS:
        return 1
    programs, split = -(-n // int4_tile(rows, n, k, group).block_n), 1
    while programs * split * 2 <= 2 * TARGET_PROGRAMS and k % (2 * split * group) == 0:
        split *= 2
    return split


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *, split_k: int = 1, pdl: bool = False,
    prefetch_k: int = 0, tile: Int4Tile | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in ``out_dtype`` (default x's), W given as ``qweight``
    [N, K/2] uint8, ``scales`` and ``mins`` [N, K/group] fp16 (engine/w4a16.py's layout).
    ``split_k`` > 1: float32 partial products [split_k, M, N] (no bias, no ``out_dtype``) for the
    next residual add + RMSNorm to sum. ``pdl``: programmatic dependent launch (Hopper+);
    ``prefetch_k`` (with it): weight columns of each slice requested into L2 before the wait;
    ``tile``: instead of :func:`int4_tile`'s (the sweeps)."""
    from engine.kernels._int4_triton import int4_gemv_kernel, int4_linear_kernel
    from engine.kernels.triton_utils import launch_options

    m, k = x.shape
    n = qweight.shape[0]
    tile = tile or int4_tile(m, n, k, group, split_k)
    if (qweight.shape != (n, k // 2) or qweight.dtype != torch.uint8 or group % 32 or split_k < 1
            or k % (split_k * group * tile.groups_per_step) or scales.shape != (n, k // group) or mins.shape != scales.shape
            or x.stride(1) != 1 or not qweight.is_contiguous() or not scales.is_contiguous() or not mins.is_contiguous()
            or (bias is not None and (bias.shape != (n,) or split_k > 1)) or (split_k > 1 and out_dtype is not None)
            or tile.kind not in ("dot", "sum") or (tile.kind == "sum" and m != 1)):
        raise ValueError(f"int4_linear: x {tuple(x.shape)} qweight {tuple(qweight.shape)} {qweight.dtype} scales {tuple(scales.shape)} "
                         f"mins {tuple(mins.shape)} group {group} split_k {split_k} bias {None if bias is None else tuple(bias.shape)} "
                         f"out_dtype {out_dtype} do not fit {tile}")
    if split_k > 1:
        y = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if tile.kind == "sum":
        int4_gemv_kernel[(-(-n // tile.block_n), split_k)](
            x, qweight, scales, mins, y, qweight if bias is None else bias, n, k, y.stride(0) if split_k > 1 else 0,
            GROUP=group, BLOCK_N=tile.block_n, SPLIT_K=split_k, HAS_BIAS=bias is not None, USE_PDL=pdl,
            PREFETCH_K=prefetch_k if pdl else 0, num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
        )
        return y
    int4_linear_kernel[(-(-n // tile.block_n), -(-m // tile.block_m), split_k)](
        x, qweight, scales, mins, y, qweight if bias is None else bias, m, n, k, x.stride(0), y.stride(-2),
        y.stride(0) if split_k > 1 else 0,
        GROUP=group, GROUPS_PER_STEP=tile.groups_per_step, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, USE_PDL=pdl, PREFETCH_K=prefetch_k if pdl else 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )
    return y


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight of :func:`int4_linear`'s layout, q * scale + min, as a new ``dtype`` tensor [N, K]:
    one pass that reads the int4 bytes once and writes the weight once (a large step's cuBLAS
    matmul then reads it; engine/w4a16.py)."""
    from engine.kernels._int4_triton import int4_dequantize_kernel

    n, k = qweight.shape[0], qweight.shape[1] * 2
    if (qweight.dtype != torch.uint8 or group % 32 or k % group or scales.shape != (n, k // group) or mins.shape != scales.shape
            or not qweight.is_contiguous() or not scales.is_contiguous() or not mins.is_contiguous()):
        raise ValueError(f"int4_dequantize: qweight {tuple(qweight.shape)} {qweight.dtype} scales {tuple(scales.shape)} "
                         f"mins {tuple(mins.shape)} group {group} do not fit")
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n = 32
    int4_dequantize_kernel[(-(-n // block_n), k // group)](qweight, scales, mins, w, n, k, GROUP=group, BLOCK_N=block_n, num_warps=4)
    return w
