"""Triton kernel for y = x @ W^T with W in group-wise int4 (W4A16): the weight streamed as nibbles.

A program owns BLOCK_N output columns (rows of W) and BLOCK_M rows of x, over the whole K. Each
K step loads BLOCK_K / 2 bytes a weight row (two weights a byte: low nibble first), splits them,
widens them to fp16 with one scale and one minimum per GROUP weights (w = q * scale + min, as
GGUF's Q4_1), and multiplies on tensor cores with x's tile cast to fp16 (int -> fp16 and
e4m3 -> fp16 are single conversions, bf16 would need two). Batch-1 steps take one 16-row M tile
(the padding rows cost no memory traffic); prefill steps take a grid of 64-row M tiles.
"""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_wait, prefetch_l2


@triton.jit
def int4_linear_kernel(
    X, QW, S, MN, Y, B, M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr = 0,
):
    """QW [N, K/2] uint8, S and MN [N, K/GROUP] fp16; K % BLOCK_K == 0 and BLOCK_K % GROUP == 0
    (the caller checks). HAS_BIAS: B [N] added in float32 before the store. PREFETCH_K (with
    USE_PDL): weight columns of this program's rows requested into L2 before the wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # masked rows read row 0: no mask on the hot loads
    m_mask = offs_m[:, None] < M
    groups = K // GROUP
    w_ptrs = QW + rows[:, None] * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    g_offs = rows[:, None] * groups + tl.arange(0, BLOCK_K // GROUP)[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    if USE_PDL and PREFETCH_K > 0:  # the first packed columns into L2 while the kernel before runs (128 bytes a line)
        lines = tl.arange(0, 8) * 128
        for k0 in range(0, PREFETCH_K // 2, 8 * 128):
            prefetch_l2(QW + rows[:, None] * (K // 2) + tl.minimum(k0 + lines, K // 2 - 1)[None, :])
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        packed = tl.load(w_ptrs, eviction_policy="evict_first")
        q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float16)  # [BLOCK_N, BLOCK_K]: weight 2j, then 2j + 1
        scale = tl.load(S + g_offs)
        low = tl.load(MN + g_offs)
        w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None] + low[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        x = tl.load(x_ptrs, mask=m_mask, other=0.0).to(tl.float16)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += BLOCK_K // 2
        g_offs += BLOCK_K // GROUP
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask & n_ok[None, :])
