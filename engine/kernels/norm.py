"""RMSNorm, and the fused "residual add + RMSNorm" that runs between every two sublayers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.triton_utils import launch_options, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, dim], or [parts, rows, dim] partial sums (a split-K GEMV's) added first."""
    if x.dim() == 3:
        residual = (x.sum(0) + residual.to(x.dtype)).to(residual.dtype)
    else:
        residual = x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """``pdl``: launch with programmatic dependent launch (CUDA, Hopper+; see _pdl_triton.py)."""
    if use_triton(x):
        return add_rms_norm_triton(x, None, weight, eps, pdl=pdl)[0]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): one pass over the rows instead of three. ``x`` may
    be [parts, rows, dim] float32 partial sums of a split-K GEMV (decode_linear's ``split_k``):
    summed here, so the split costs no reduction kernel. ``pdl``: the kernel reads ``residual``
    before it waits for the kernel before it, so that kernel must not be the one writing it (in
    the model the residual comes from the norm before the sublayer)."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps, pdl=pdl)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    from engine.kernels._norm_triton import add_rms_norm_kernel

    parts = x.shape[0] if x.dim() == 3 else 1
    if parts > 1 and residual is None:
        raise ValueError("add_rms_norm: partial sums need the residual they are added to")
    rows, dim = x.shape[-2:]
    out = torch.empty((rows, dim), dtype=residual.dtype if residual is not None else x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    block = triton.next_power_of_2(dim)
    add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, dim, eps, x.stride(0) if parts > 1 else 0,
        HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl, PARTS=parts, num_warps=4 if block <= 2048 else 8,
        **launch_options(pdl),
    )
    return out, res_out
