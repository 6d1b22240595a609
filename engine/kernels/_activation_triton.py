"""Triton kernel for silu(gate) * up."""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_wait


@triton.jit
def silu_and_mul_kernel(X, OUT, f, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    gate = tl.load(X + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * f + cols, y.to(OUT.dtype.element_ty), mask=mask)
