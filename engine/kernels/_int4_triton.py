"""Triton kernel for y = x @ W^T with W in group-wise int4 (W4A16): the weight streamed as nibbles.

A program owns BLOCK_N output columns (rows of W) and BLOCK_M rows of x, over its 1/SPLIT_K slice
of K. The weight is laid out by groups of GROUP inputs: a group's GROUP / 2 bytes hold its first
half in their low nibbles and its second half in their high nibbles, so each half is one mask or
shift away from a [BLOCK_N, GROUP / 2] tile, multiplied by the matching half of x's tile - no
interleaving of registers. Each group has one fp16 scale and minimum (w = q * scale + min, GGUF's
Q4_1 rule). Weights and x are multiplied in fp16 on tensor cores (int -> fp16 is one conversion,
bf16 would need two); GROUPS_PER_STEP groups a loop iteration keep more bytes in flight.
With SPLIT_K > 1 the programs of grid axis 2 store float32 partials [SPLIT_K, M, N] that the next
residual add + RMSNorm sums (as the bf16 GEMV's split-K, engine/kernels/_linear_triton.py).
A first version (2026-12-03) interleaved the nibbles (tl.interleave) and reshaped each tile by
groups: 330-1,050 GB/s on the 8B's projections at batch 1, 136.7 tok/s, below bf16's 244.6.
"""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_wait, prefetch_rows_l2


@triton.jit
def int4_linear_kernel(
    X, QW, S, MN, Y, B, M, N, K, stride_xm, stride_ym, stride_ys,
    GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr = 0,
):
    """QW [N, K/2] uint8 (see the module doc), S and MN [N, K/GROUP] fp16; K/SPLIT_K a multiple of
    GROUP * GROUPS_PER_STEP (the caller checks). HAS_BIAS (SPLIT_K 1): B [N] added in float32 before
    the store. PREFETCH_K (with USE_PDL): weight columns of this program's rows and slice requested
    into L2 before the wait."""
    HALF: tl.constexpr = GROUP // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_len = K // SPLIT_K
    k_first = pid_k * k_len
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # masked rows read row 0: no mask on the hot loads
    m_mask = offs_m[:, None] < M
    w_ptrs = QW + rows[:, None] * (K // 2) + k_first // 2 + offs_h[None, :]
    g_offs = rows * (K // GROUP) + k_first // GROUP
    x_ptrs = X + offs_m[:, None] * stride_xm + k_first + offs_h[None, :]
    if USE_PDL and PREFETCH_K > 0:  # the slice's first packed columns into L2 while the kernel before runs (128-byte lines)
        prefetch_rows_l2(QW + rows[:, None] * (K // 2) + k_first // 2, k_len // 2, PREFETCH_K // 2, 128)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, k_len // GROUP, GROUPS_PER_STEP):
        for j in tl.static_range(GROUPS_PER_STEP):
            packed = tl.load(w_ptrs + (g0 + j) * HALF, eviction_policy="evict_first")
            scale = tl.load(S + g_offs + g0 + j)[:, None]
            low = tl.load(MN + g_offs + g0 + j)[:, None]
            x_lo = tl.load(x_ptrs + (g0 + j) * GROUP, mask=m_mask, other=0.0).to(tl.float16)
            x_hi = tl.load(x_ptrs + (g0 + j) * GROUP + HALF, mask=m_mask, other=0.0).to(tl.float16)
            w_lo = (packed & 0xF).to(tl.float16) * scale + low
            w_hi = (packed >> 4).to(tl.float16) * scale + low
            acc = tl.dot(x_lo, tl.trans(w_lo), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask & n_ok[None, :])


@triton.jit
def int4_gemv_kernel(
    X, QW, S, MN, Y, B, N, K, stride_ys,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr = 0,
):
    """One row of x (batch 1) on the CUDA cores: each program owns BLOCK_N weight rows over its K
    slice and never lays a tile out again for tensor cores. Per group it sums q * x over the
    group's two halves (nibbles widened by the fp16 bit trick: ``q | 0x6400`` read as fp16 is
    1024 + q, so no integer conversion), then adds scale * that + min * sum(x of the group):
    w = q * scale + min factored out of the inner product. Same layout, arguments and split-K
    partials as :func:`int4_linear_kernel` (Y [SPLIT_K, 1, N] float32 when split)."""
    HALF: tl.constexpr = GROUP // 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_len = K // SPLIT_K
    k_first = pid_k * k_len
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    w_ptrs = QW + rows[:, None] * (K // 2) + k_first // 2 + offs_h[None, :]
    g_offs = rows * (K // GROUP) + k_first // GROUP
    x_ptrs = X + k_first + offs_h
    if USE_PDL and PREFETCH_K > 0:
        prefetch_rows_l2(QW + rows[:, None] * (K // 2) + k_first // 2, k_len // 2, PREFETCH_K // 2, 128)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g in range(0, k_len // GROUP):
        packed = tl.load(w_ptrs + g * HALF, eviction_policy="evict_first").to(tl.uint16)
        x_lo = tl.load(x_ptrs + g * GROUP).to(tl.float32)
        x_hi = tl.load(x_ptrs + g * GROUP + HALF).to(tl.float32)
        q_lo = ((packed & 0xF) | 0x6400).to(tl.float16, bitcast=True).to(tl.float32) - 1024.0
        q_hi = ((packed >> 4) | 0x6400).to(tl.float16, bitcast=True).to(tl.float32) - 1024.0
        qx = tl.sum(q_lo * x_lo[None, :] + q_hi * x_hi[None, :], axis=1)
        x_sum = tl.sum(x_lo, axis=0) + tl.sum(x_hi, axis=0)
        scale = tl.load(S + g_offs + g).to(tl.float32)
        low = tl.load(MN + g_offs + g).to(tl.float32)
        acc += scale * qx + low * x_sum
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + pid_k * stride_ys + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def int4_dequantize_kernel(QW, S, MN, W, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [N, K] (its dtype) = q * scale + min for the groups of QW [N, K/2] uint8 (module doc's
    layout), S and MN [N, K/GROUP] fp16: one group of BLOCK_N rows a program, float32 arithmetic."""
    HALF: tl.constexpr = GROUP // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    h = tl.arange(0, HALF)
    packed = tl.load(QW + rows[:, None] * (K // 2) + g * HALF + h[None, :], mask=n_ok[:, None], other=0)
    scale = tl.load(S + rows * (K // GROUP) + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    low = tl.load(MN + rows * (K // GROUP) + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    w_ptrs = W + rows[:, None] * K + g * GROUP + h[None, :]
    tl.store(w_ptrs, ((packed & 0xF).to(tl.float32) * scale + low).to(W.dtype.element_ty), mask=n_ok[:, None])
    tl.store(w_ptrs + HALF, ((packed >> 4).to(tl.float32) * scale + low).to(W.dtype.element_ty), mask=n_ok[:, None])
