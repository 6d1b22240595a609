"""SwiGLU's activation: silu(gate) * up on the fused gate|up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.triton_utils import launch_options, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """x [T, 2F] -> [T, F]; one kernel instead of split + silu + mul (``pdl``: see _pdl_triton.py)."""
    return silu_and_mul_triton(x, pdl=pdl) if use_triton(x) else silu_and_mul_ref(x)


def silu_and_mul_triton(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    from engine.kernels._activation_triton import silu_and_mul_kernel

    rows, two_f = x.shape
    f = two_f // 2
    out = torch.empty((rows, f), dtype=x.dtype, device=x.device)
    block = 1024
    silu_and_mul_kernel[(rows, -(-f // block))](x, out, f, BLOCK=block, USE_PDL=pdl, **launch_options(pdl))
    return out
