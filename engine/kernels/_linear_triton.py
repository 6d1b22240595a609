"""Triton kernels for y = x @ W^T with few rows of x (decode): the weight streamed once.

At decode batch sizes a projection is a matrix-vector product bound by reading W. A program
owns BLOCK_N output columns (rows of W) over the whole K: it streams its slice of W through
``num_stages`` pipelined loads and multiplies on tensor cores with x's rows padded to BLOCK_M
(the padding rows cost no memory traffic). With SPLIT_K > 1 the programs of grid axis 1 each
take a 1/SPLIT_K slice of K and store float32 partials [SPLIT_K, M, N]: more programs for a
weight with few rows, and no reduction kernel - the next residual add + RMSNorm sums them.

``PREFETCH_K`` (with PDL): before waiting for the previous kernel, a program asks L2 for the
first PREFETCH_K columns of its weight rows (``prefetch.global.L2``; weights never depend on the
kernel before). On the 8B's wide weights, which stream at the copy bandwidth anyway, 8 MiB a
projection was within noise of none (batch-1 graph replay 4.20 / 4.19 ms), 32 MiB 8% slower
(2026-11-30); it is for small weights, whose GEMVs wait on DRAM latency rather than bandwidth
(``GemvPolicy.prefetch_bytes``).

Tried and not kept (H200): (1) see PREFETCH_K above for wide weights. (2) Computing the operand
in the loop - RMSNorm(x + residual) before q|k|v or gate|up,
silu(gate) * up before down_proj - so that op needs no kernel of its own
(``kernel_bench --decode-linear``). A computed operand cannot be prefetched like a loaded one: the
norm versions took 44.5 / 78.7 us where the separate kernels and cuBLAS took 17.3 / 63.1 us,
the SwiGLU one 279 us against 32.4. Tried again (2026-11-30) with the norm's 1/rms applied in the
epilogue (the operand is the residual stream times the norm weight, its mean square summed in the
loop) and the operand's loads issued an iteration ahead: 32 layers of q|k|v, o_proj, gate|up and
down_proj with both norms folded replayed in 4.63 ms (7.53 without the early loads) against 3.69-
3.75 with the norm kernels. (3) The residual add + RMSNorm after o_proj and down_proj run by the
GEMV's last program to finish (each program counted itself done with an atomic; the last read the
row back, normalized it and reset the count): on the Qwen2.5-1.5B shape the batch-1 graph replay
took 1.545 ms against 1.320 with the norm kernels (H200, 2026-12-03, three interleaved rounds).
(4) A GEMV asking L2, after its K loop, for a later small weight (q|k|v for o_proj across
attention, gate|up for the next layer's q|k|v, o_proj for down_proj): on the 1.5B shape the
batch-1 replay took 1.347 / 1.320 / 1.372 ms against 1.301-1.321 without (H200, 2026-12-04, three
rounds): the small GEMVs' ~5 us is not their weight's DRAM latency.
(5) q|k|v's GEMV asking L2, after its K loop, for 8-40 MiB of its layer's gate|up weight (55 MB
on the 1.5B), so that it came during attention, when DRAM is idle: one prefetch a line or one bulk
(TMA) request per 32 KiB, the batch-1 replay was slower at every size (1.5B: 1.317 ms without,
1.334 with 8 MiB in bulk, 1.381 with 32; the 8B shape 4.07 -> 4.08-4.15; H200, 2026-12-04, three
rounds): what gate|up gains from L2 is less than what the requests cost the chain.

``LATE_RELEASE`` (with PDL): the next kernel may launch only after the K loop, not right after
the wait (GemvPolicy.late_release says for which projections it pays).
"""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_release, pdl_wait, prefetch_rows_l2


@triton.jit
def decode_linear_kernel(
    X, W, Y, B, S, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr, LATE_RELEASE: tl.constexpr = False,
    COLUMNS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False, HAS_SCALE: tl.constexpr = False, FP8_MATH: tl.constexpr = 0,
    PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64,
):
    """GATED: W is [gate; up] (2N rows) and the program writes silu(x @ gate^T) * (x @ up^T) for
    its N-columns - SwiGLU in the epilogue, so no activation kernel and no [M, 2N] round trip.
    COLUMNS (<= BLOCK_N; 0: BLOCK_N): the output columns a program owns; fewer than the tile's
    width spread the weight's rows evenly over the SMs (the masked rows cost no memory traffic).
    HAS_BIAS: B [N] is added to the float32 accumulator before the store (not GATED, SPLIT_K 1;
    otherwise B is unused). HAS_SCALE: W is FP8 (e4m3) with float32 scales S per row of W (2N
    when GATED), half the bytes streamed of a bf16 weight; the accumulators are scaled per column
    before SwiGLU, bias and store. FP8_MATH (with HAS_SCALE): 0 widens each weight tile to x's
    dtype in registers (W8A16); 1 widens the tile and x to fp16 (e4m3 -> fp16 is one conversion);
    2 rounds x to e4m3 with one scale per row (its largest magnitude over the whole K, found by a
    first pass over x) and multiplies on FP8 tensor cores (W8A8, no weight conversion).
    PREFETCH_K (> 0 with USE_PDL): columns of this program's K slice requested into L2 before the
    wait, 8 lines of LINE elements (128 bytes) a row per round, clamped into the program's rows and
    slice."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_len = K // SPLIT_K  # the caller checks K % (SPLIT_K * BLOCK_K) == 0 when split
    k_first = pid_k * k_len
    offs_m = tl.arange(0, BLOCK_M)
    if COLUMNS == 0 or COLUMNS == BLOCK_N:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    else:
        offs_n = pid * COLUMNS + tl.arange(0, BLOCK_N)
        n_ok = (tl.arange(0, BLOCK_N) < COLUMNS) & (offs_n < N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    n_mask = n_ok[:, None]
    up_offset = N * stride_wn  # gate row j's partner: up row j, N rows further
    if USE_PDL and PREFETCH_K > 0:  # the weight's first columns into L2 while the kernel before runs
        own_rows = tl.where(n_ok, offs_n, pid * (BLOCK_N if COLUMNS == 0 else COLUMNS))
        row_ptrs = W + own_rows.to(tl.int64)[:, None] * stride_wn + k_first
        prefetch_rows_l2(row_ptrs, k_len, PREFETCH_K, LINE)
        if GATED:
            prefetch_rows_l2(row_ptrs + up_offset, k_len, PREFETCH_K, LINE)
    pdl_wait(USE_PDL, not LATE_RELEASE)
    if HAS_SCALE and FP8_MATH == 2:  # x's per-row scale over the whole K: a few KB, read again from L2
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        xa_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        for k0 in range(0, K, BLOCK_K):
            xa = tl.load(xa_ptrs, mask=m_mask & ((k0 + offs_k)[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), axis=1))
            xa_ptrs += BLOCK_K
        x_scale = tl.maximum(amax, 1e-12) / 448.0
    x_ptrs = X + offs_m[:, None] * stride_xm + k_first + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k_first + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:  # no mask along the contiguous dimension
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask, other=0.0, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=n_mask, other=0.0, eviction_policy="evict_first")
        else:
            k_ok = (k + offs_k)[None, :] < K
            x = tl.load(x_ptrs, mask=m_mask & k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask & k_ok, other=0.0, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=n_mask & k_ok, other=0.0, eviction_policy="evict_first")
        if HAS_SCALE:
            if FP8_MATH == 0:
                w = w.to(x.dtype)
                if GATED:
                    w_up = w_up.to(x.dtype)
            elif FP8_MATH == 1:
                x = x.to(tl.float16)
                w = w.to(tl.float16)
                if GATED:
                    w_up = w_up.to(tl.float16)
            else:
                x = (x.to(tl.float32) / x_scale[:, None]).to(W.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    if HAS_SCALE:
        acc *= tl.load(S + offs_n, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(S + N + offs_n, mask=n_ok, other=0.0)[None, :]
        if FP8_MATH == 2:
            acc *= x_scale[:, None]
            if GATED:
                acc_up *= x_scale[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if HAS_BIAS:
        bias = tl.load(B + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y_ptrs = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask & n_ok[None, :])


@triton.jit
def gemv_sum_kernel(
    X, W, Y, B, N, K, stride_wn, stride_ys,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64,
):
    """One row of x (batch 1): multiply-and-reduce on the CUDA cores, no tensor-core padding
    (K % (SPLIT_K * BLOCK_K) == 0). Narrow weights of a few MB (the 1.5B's q|k|v and o_proj) ran
    faster so in isolation than the "dot" tiles (4.2 / 3.9 us against 4.9 / 5.0, H200 sweep,
    2026-12-03). SPLIT_K, HAS_BIAS (SPLIT_K 1 only), USE_PDL and PREFETCH_K as in
    decode_linear_kernel (partials [SPLIT_K, 1, N] in float32)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_len = K // SPLIT_K
    k_first = pid_k * k_len
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k_first + offs_k[None, :]
    if USE_PDL and PREFETCH_K > 0:  # the weight's first columns into L2 while the kernel before runs
        own_rows = tl.where(n_ok, offs_n, pid * BLOCK_N)
        prefetch_rows_l2(W + own_rows.to(tl.int64)[:, None] * stride_wn + k_first, k_len, PREFETCH_K, LINE)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        x = tl.load(X + k_first + k + offs_k).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + pid_k * stride_ys + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)
