"""Triton kernel for (residual add +) RMSNorm: one program per row, float32 statistics."""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_wait


@triton.jit
def add_rms_norm_kernel(X, R, W, OUT, R_OUT, dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    pdl_wait(USE_PDL)
    x = tl.load(X + row * dim + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * dim + cols, mask=mask, other=0.0)
        tl.store(R_OUT + row * dim + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / dim
    y = xf * tl.rsqrt(var + eps) * w
    tl.store(OUT + row * dim + cols, y.to(OUT.dtype.element_ty), mask=mask)
