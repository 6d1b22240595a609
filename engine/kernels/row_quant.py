"""Per-row (per-token) rounding of activations to e4m3 for the FP8 matmuls (W8A8).

Before each FP8 matmul of a step of many rows, x [M, K] is rounded row by row: its largest
magnitude maps to e4m3's largest finite value. In torch that is six elementwise passes (|x|, the
row maximum, a float32 copy, divide, clamp, cast), each a kernel that reads and writes the whole
activation. This kernel reads each row twice (the second time from cache) and writes it once in
e4m3, with the same codes and scales. Measured on the H200 for a 16,384-token step of the 8B
shape (2026-12-03, engine/bench/experiments/fp8_prefill_parts.py): 20.6 ms a step against 164.9
in torch, and the whole FP8 prefill forward 425.5 ms against 547.2 (bf16: 547.3), because in torch
the rounding cost what the FP8 matmuls saved."""

from __future__ import annotations

import torch

from engine.kernels.triton_utils import runs_triton

BLOCK = 1024  # elements of a row a loop step: 4 KB of float32 in registers over 4 warps


def quantize_rows_triton(x: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M]) with x ~ q * scale per row."""
    from engine.kernels._row_quant_triton import quantize_rows_kernel

    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_triton: x must be 2-D with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max, BLOCK=BLOCK, num_warps=4)
    return q, scale


def can_quantize_rows(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` (CUDA or the interpreter; 2-D with contiguous rows)."""
    return runs_triton(x) and x.dim() == 2 and x.stride(1) == 1
