"""Projections at decode batch sizes: a Triton GEMV that streams the weight once (CUDA).

``gemv(x, w, config)`` computes ``x @ w.T`` for x of at most ``BLOCK_M`` rows with the kernel
and tile shape in ``config``; ``python -m engine.kernel_bench --gemv`` times it against cuBLAS
(``F.linear``) on Llama-3.1-8B's projection shapes. The model does not use it: on the H200 the
best tile per shape was within 0-12% of cuBLAS (2% of a batch-1 step's projection time,
docs/performance.md), so it is kept as the measured baseline for a fused decode GEMV (norm or
activation in its prologue), which is where a custom kernel could still pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GemvConfig:
    kind: str  # "dot": tensor cores, x padded to block_m rows; "sum": one row, CUDA cores
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 16

    def fits(self, rows: int, k: int) -> bool:
        return k % self.block_k == 0 and (rows <= self.block_m if self.kind == "dot" else rows == 1)


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] with the Triton kernel named by ``config``."""
    from engine.kernels._linear_triton import gemv_dot_kernel, gemv_sum_kernel

    m, k = x.shape
    n = w.shape[0]
    if not config.fits(m, k) or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv {config} cannot take x {tuple(x.shape)} and w {tuple(w.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (-(-n // config.block_n),)
    if config.kind == "dot":
        gemv_dot_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                              BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        gemv_sum_kernel[grid](x, w, y, n, k, w.stride(0), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              num_warps=config.num_warps, num_stages=config.num_stages)
    return y
