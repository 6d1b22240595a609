"""Triton kernel: round each row of x to e4m3 with its own scale, in one pass over x's bytes
(two reads of the row, which stays in L1/L2 between them; one e4m3 write)."""

import triton
import triton.language as tl


@triton.jit
def quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: scale = max(amax(|x|), 1e-12) / FP8_MAX, q = clamp(x / scale) in e4m3
    (the rule of engine/fp8.py quantize_rows)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(Q + row * stride_q + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)
