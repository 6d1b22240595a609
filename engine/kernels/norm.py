"""RMSNorm, and the fused "residual add + RMSNorm" that runs between every two sublayers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.triton_utils import launch_options, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
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
    """(rmsnorm(x + residual), x + residual): one pass over the rows instead of three."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps, pdl=pdl)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    from engine.kernels._norm_triton import add_rms_norm_kernel

    rows, dim = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(dim)
    add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl, num_warps=4 if block <= 2048 else 8, **launch_options(pdl),
    )
    return out, res_out
