"""Projections with group-wise int4 weights on CUDA (W4A16): one Triton kernel for every step size.

``int4_linear(x, weight)`` computes x @ W^T for an :class:`~engine.w4a16.Int4Weight`: steps of at
most 16 rows (decode) take one 16-row M tile and weight tiles of few rows, so that every SM gets
programs; larger steps (prefill) take 64 x 128 tiles. The weight's nibbles are widened in
registers, never written out as bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE_ROWS = 16  # a step of up to this many rows takes one M tile


@dataclass(frozen=True)
class Int4Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def int4_tile(rows: int, n: int, k: int) -> Int4Tile:
    """The tile for x [rows, k] @ W [n, k]^T. K steps of 256 weights (128 bytes a row) where K
    allows, else 128."""
    block_k = 256 if k % 256 == 0 else 128
    if rows <= DECODE_ROWS:
        return Int4Tile(16, 32 if n < 4096 else 64, block_k, 4, 4)
    return Int4Tile(64, 128, 128, 8, 3)


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *, pdl: bool = False, prefetch_k: int = 0,
    tile: Int4Tile | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in ``out_dtype`` (default x's), W given as ``qweight``
    [N, K/2] uint8 (two weights a byte, low nibble first), ``scales`` and ``mins`` [N, K/group] fp16.
    ``pdl``: programmatic dependent launch (Hopper+); ``prefetch_k`` (with it): weight columns
    requested into L2 before the wait; ``tile``: instead of :func:`int4_tile`'s (the sweeps)."""
    from engine.kernels._int4_triton import int4_linear_kernel
    from engine.kernels.triton_utils import launch_options

    m, k = x.shape
    n = qweight.shape[0]
    tile = tile or int4_tile(m, n, k)
    if (qweight.shape != (n, k // 2) or qweight.dtype != torch.uint8 or k % tile.block_k or tile.block_k % group
            or scales.shape != (n, k // group) or mins.shape != scales.shape or x.stride(1) != 1 or not qweight.is_contiguous()
            or not scales.is_contiguous() or not mins.is_contiguous() or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"int4_linear: x {tuple(x.shape)} qweight {tuple(qweight.shape)} {qweight.dtype} scales {tuple(scales.shape)} "
                         f"mins {tuple(mins.shape)} group {group} bias {None if bias is None else tuple(bias.shape)} do not fit {tile}")
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    int4_linear_kernel[(-(-n // tile.block_n), -(-m // tile.block_m))](
        x, qweight, scales, mins, y, qweight if bias is None else bias, m, n, k, x.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, HAS_BIAS=bias is not None,
        USE_PDL=pdl, PREFETCH_K=prefetch_k if pdl else 0, num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )
    return y
