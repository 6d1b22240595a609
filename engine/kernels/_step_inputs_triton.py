"""Triton kernel scattering a packed decode step into the decode graph's buffers (step_inputs.py)."""

import triton
import triton.language as tl


@triton.jit
def scatter_decode_inputs_kernel(
    P, TOKENS, IDS, POS, SLOTS, SEQ_LENS, TABLES, stride_table, HEADER: tl.constexpr, FIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program i: row i of the step, or a padding row when i >= n."""
    i = tl.program_id(0)
    n = tl.load(P)
    width = tl.load(P + 1)
    real = i < n
    row = P + HEADER + i
    src = tl.load(row + 4 * n, mask=real, other=-1)
    tok = tl.load(row, mask=real, other=0).to(tl.int64)
    tok = tl.where(src >= 0, tl.load(TOKENS + tl.maximum(src, 0)), tok)
    tl.store(IDS + i, tok)
    tl.store(POS + i, tl.load(row + n, mask=real, other=0).to(tl.int64))
    tl.store(SLOTS + i, tl.load(row + 2 * n, mask=real, other=0).to(tl.int64))
    tl.store(SEQ_LENS + i, tl.load(row + 3 * n, mask=real, other=0))
    table = P + HEADER + FIELDS * n + i * width
    cols = tl.arange(0, BLOCK)
    for c in range(0, tl.where(real, width, 0), BLOCK):
        m = c + cols < width
        tl.store(TABLES + i * stride_table + c + cols, tl.load(table + c + cols, mask=m), mask=m)
