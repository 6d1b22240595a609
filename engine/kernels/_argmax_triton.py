"""Triton kernels for the row-wise argmax of float32 logits (greedy sampling) in two passes."""

import triton
import triton.language as tl


@triton.jit
def chunk_argmax_kernel(X, VAL, IDX, n, stride_x, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row, chunk): the max of its CHUNK columns and the first column holding it."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n, other=float("-inf"))
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, cols, n), 0)  # ties: the lowest column, as torch.argmax
    tl.store(VAL + row * NUM_CHUNKS + chunk, best)
    tl.store(IDX + row * NUM_CHUNKS + chunk, first)


@triton.jit
def final_argmax_kernel(VAL, IDX, OUT, n, NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Program row: the best of its chunks' maxima (ties: the lowest chunk, so the lowest column)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    mask = c < NUM_CHUNKS
    v = tl.load(VAL + row * NUM_CHUNKS + c, mask=mask, other=float("-inf"))
    i = tl.load(IDX + row * NUM_CHUNKS + c, mask=mask, other=n)
    best = tl.max(v, 0)
    tl.store(OUT + row, tl.min(tl.where(v == best, i, n), 0).to(tl.int64))
