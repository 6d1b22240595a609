"""Triton kernel for one row of x times a group-wise int4 weight (W4A16 at batch 1), two weights an
instruction: the "pairs" GEMV.

The weight is held as int32 words [N, K/8] (engine/kernels/int4_pairs_gemv.py ``pack_pairs``):
word i of a row holds inputs 8i..8i+7, input 8i + 2p + h in bits 16h + 4p..16h + 4p + 3. Masking
a word with 0x000F000F (after a shift by 4p) gives the nibbles of inputs 8i + 2p and 8i + 2p + 1
in the two 16-bit halves; OR-ing 0x4300 into each half (one LOP3) makes them the bf16 pair
(128 + q0, 128 + q1), one bf16x2 subtract of 136 makes it (q0 - 8, q1 - 8) exactly (centred, so
that the sums below do not carry 7.5 x sum(x) only for the minimums' term to take it away again:
7e-3 relative error uncentred, on the H100), and one bf16x2 FMA multiplies
it by x's pair (x[8i + 2p], x[8i + 2p + 1]) - which is how a bf16 row of x lies in memory, so x is
read as int32 pairs and needs no preparation. About 2 instructions a weight where widening each
nibble on its own takes 4-5 (shift, mask, convert, FMA): at 0.5 bytes a weight the CUDA cores, not
DRAM, bounded the one-weight-at-a-time kernels (engine/kernels/_int4_triton.py int4_gemv_kernel).

Arithmetic: a word's 8 products are summed in bf16 (the FMA chain of four pairs, each rounding once
to 8 significant bits), its two halves in float32, words and groups in float32:
y = sum over groups of scale * sum((q - 8) * x) + (min + 8 * scale) * sum(x) (w = q * scale + min,
GGUF's Q4_1 rule, as engine/w4a16.py). bf16, not fp16, so that no input of any size overflows (fp16 would stop at
65,504 for 4 x 15 x |x|, a few layers' down_proj inputs of real models reach the thousands).
With SPLIT_K > 1 the programs of grid axis 1 store float32 partials [SPLIT_K, N] for the next
residual add + RMSNorm to sum, as the other decode GEMVs.
"""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_release, pdl_wait, prefetch_rows_l2


@triton.jit
def _word_products(w, xa, xb, xc, xd):
    """sum((q - 8) * x) over each int32 word's 8 weights against x's four bf16 pairs (as int32),
    float32. PTX: 4 shifts/LOP3s make the nibble pairs bf16 pairs, 4 bf16x2 subtracts and 4
    multiplies or FMAs, then the two bf16 halves of the sum widened (a shift, a mask) and added."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 magic, centre, s, a, b, c, d, acc, lo, hi;
        .reg .f32 f0, f1, f2;
        mov.b32 magic, 0x43004300;
        mov.b32 centre, 0x43084308;
        lop3.b32 a, $1, 0x000F000F, magic, 0xEA;
        shr.b32 s, $1, 4;
        lop3.b32 b, s, 0x000F000F, magic, 0xEA;
        shr.b32 s, $1, 8;
        lop3.b32 c, s, 0x000F000F, magic, 0xEA;
        shr.b32 s, $1, 12;
        lop3.b32 d, s, 0x000F000F, magic, 0xEA;
        sub.rn.bf16x2 a, a, centre;
        sub.rn.bf16x2 b, b, centre;
        sub.rn.bf16x2 c, c, centre;
        sub.rn.bf16x2 d, d, centre;
        mul.rn.bf16x2 acc, a, $2;
        fma.rn.bf16x2 acc, b, $3, acc;
        fma.rn.bf16x2 acc, c, $4, acc;
        fma.rn.bf16x2 acc, d, $5, acc;
        shl.b32 lo, acc, 16;
        and.b32 hi, acc, 0xFFFF0000;
        mov.b32 f0, lo;
        mov.b32 f1, hi;
        add.f32 f2, f0, f1;
        mov.b32 $0, f2;
        }""",
        constraints="=r,r,r,r,r,r",
        args=[w, xa, xb, xc, xd],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit
def _pair_lo(p):
    """The first (low) bf16 of an int32 pair, as float32."""
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _pair_hi(p):
    """The second (high) bf16 of an int32 pair, as float32."""
    return (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _centred(w, shift):
    """The nibble at ``shift`` of each word, less 8, as float32."""
    return ((w >> shift) & 0xF).to(tl.float32) - 8.0


@triton.jit
def _word_products_plain(w, xa, xb, xc, xd):
    """What :func:`_word_products` computes, one weight at a time in float32: the path Triton's CPU
    interpreter runs (it cannot run PTX)."""
    part = _centred(w, 0) * _pair_lo(xa) + _centred(w, 16) * _pair_hi(xa)
    part += _centred(w, 4) * _pair_lo(xb) + _centred(w, 20) * _pair_hi(xb)
    part += _centred(w, 8) * _pair_lo(xc) + _centred(w, 24) * _pair_hi(xc)
    part += _centred(w, 12) * _pair_lo(xd) + _centred(w, 28) * _pair_hi(xd)
    return part


@triton.jit
def int4_pairs_gemv_kernel(
    XP, QW, S, MN, Y, B, N, K, stride_ys,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_W: tl.constexpr = 0, USE_ASM: tl.constexpr = True, LATE_RELEASE: tl.constexpr = False,
):
    """Y = W @ x for one row x, given as int32 bf16 pairs XP [K/2]. QW [N, K/8] int32 words (module
    doc), S and MN [N, K/GROUP] fp16 scales and minimums. The caller checks: N a multiple of
    BLOCK_N, each K slice (K / 8 / SPLIT_K words) a multiple of BLOCK_W, itself of GROUP / 8.
    HAS_BIAS (SPLIT_K 1): B [N] added in float32. PREFETCH_W (with USE_PDL): words of each row's
    slice requested into L2 before the wait. LATE_RELEASE (with USE_PDL): the next kernel may launch
    only after this program's K loop, not right after its wait. USE_ASM False: the interpreter's
    float32 products."""
    GW: tl.constexpr = GROUP // 8  # words a group
    GROUPS: tl.constexpr = BLOCK_W // GW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kw = K // 8
    w_len = kw // SPLIT_K
    w_first = pid_k * w_len
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)
    words = tl.arange(0, BLOCK_W)
    w_ptrs = QW + rows[:, None] * kw + w_first + words[None, :]
    g_offs = rows * (K // GROUP) + w_first // GW
    if USE_PDL and PREFETCH_W > 0:  # the slice's first words into L2 while the kernel before runs (32 words a line)
        prefetch_rows_l2(QW + rows[:, None] * kw + w_first, w_len, PREFETCH_W, 32)
    pdl_wait(USE_PDL, RELEASE=not LATE_RELEASE)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(0, w_len, BLOCK_W):
        w = tl.load(w_ptrs + w0, eviction_policy="evict_first")
        x4 = tl.load(XP + (w_first + w0 + words)[:, None] * 4 + tl.arange(0, 4)[None, :])  # a word's four pairs: one 16-byte load
        x_ac, x_bd = tl.split(tl.reshape(x4, (BLOCK_W, 2, 2)))
        xa, xc = tl.split(x_ac)
        xb, xd = tl.split(x_bd)
        x_words = tl.sum(_pair_lo(x4) + _pair_hi(x4), axis=1)  # sum(x) a word, then a group: the minimums' term
        x_groups = tl.sum(tl.reshape(x_words, (GROUPS, GW)), axis=1)
        xa, xb = tl.broadcast_to(xa[None, :], (BLOCK_N, BLOCK_W)), tl.broadcast_to(xb[None, :], (BLOCK_N, BLOCK_W))
        xc, xd = tl.broadcast_to(xc[None, :], (BLOCK_N, BLOCK_W)), tl.broadcast_to(xd[None, :], (BLOCK_N, BLOCK_W))
        if USE_ASM:
            part = _word_products(w, xa, xb, xc, xd)
        else:
            part = _word_products_plain(w, xa, xb, xc, xd)
        by_group = tl.sum(tl.reshape(part, (BLOCK_N, GROUPS, GW)), axis=2)
        g = w0 // GW + tl.arange(0, GROUPS)
        scale = tl.load(S + g_offs[:, None] + g[None, :]).to(tl.float32)
        low = tl.load(MN + g_offs[:, None] + g[None, :]).to(tl.float32) + 8.0 * scale  # the centred nibbles' minimum
        acc += tl.sum(scale * by_group + low * x_groups[None, :], axis=1)
    if LATE_RELEASE:
        pdl_release(USE_PDL)
    if HAS_BIAS:
        acc += tl.load(B + offs_n).to(tl.float32)
    tl.store(Y + pid_k * stride_ys + offs_n, acc.to(Y.dtype.element_ty))
