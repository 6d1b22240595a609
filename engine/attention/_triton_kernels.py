"""Triton kernels for attention over the paged KV cache.

Strides and split counts that change from step to step are not specialised on
(``do_not_specialize``): a new value must never trigger a JIT compile in the middle of serving.

Cache layout: K and V each ``[num_blocks, page, kv_heads, head_dim]``; a request's token ``t``
lives in block ``block_table[t // page]`` at row ``t % page``. With ``FP8`` the cache holds e4m3
values and K_SCALE / V_SCALE ``[num_blocks, page, kv_heads]`` one float32 scale per row
(engine/kv_cache.py): the write quantizes each (token, head) row by its amax after RoPE; the reads
widen the e4m3 tile to float16 for the dot (q goes to float16 too) and apply the scales exactly and
cheaply, K's to the score columns after the dot, V's to the probabilities' columns before ``p @ v``
(divided by the tile's largest V scale, which multiplies the product: p stays in [0, 1], where
float16 keeps its precision). Float16, not the model's bf16: e4m3 widens to float16 two values an
instruction (``cvt.rn.f16x2.e4m3x2``); to bf16 Triton adds a float16 -> bf16 conversion of each
value and the unpacking (sm_90 PTX of the decode kernel: 192 ``cvt.bf16.f16`` and 96
``cvt.u32.u16`` more; the prefill kernel 512 more). V is widened by inline PTX (``_widen_e4m3``)
before its dot: with Triton's own conversion the compiler loads the e4m3 tile from shared memory
straight into the dot's operand layout, which wants four consecutive tokens of one column a
thread - one ``ld.shared.b8`` per value, as tokens are a row apart - and the loop starved on
shared-memory loads (decode read an FP8 cache at half a bf16 cache's GB/s). The PTX block takes
four values a 32-bit register: the registers the V tile is loaded into go to it whole, where two
values a block had each pair split off its word and paired again, six integer instructions a pair
(about a fifth of the decode kernel's instructions in Triton 3.6's sm_90 PTX).

- ``rope_store_kernel``: per token, rotate q (in place) and k by the token's position, and
  write k and v into their cache slot: one launch instead of a gather + ~10 elementwise ops.
- ``split_kv_decode_attention`` + ``combine_kernel``: split-KV ("flash decoding") attention for
  one query per request. A program handles all query heads of one KV head (GQA: K/V are read once per group)
  over one slice of the context; the combine kernel merges the slices by their log-sum-exp.
  Splitting keeps the GPU busy when few requests have long contexts; a batch large enough to
  fill the GPU unsplit (one slice) writes its output directly and launches no combine.
  Tried and not kept (H200, 2026-11-30): with PDL, loading a split's first K/V tile before the
  wait (the cached context does not depend on the q|k|v projection running before it) made the
  batch-1 graph replay slower, 4.225 against 4.134 ms (two rounds each, ``engine.bench latency``).
- ``prefill_kernel``: FlashAttention-style tiles of (query, head) rows of one GQA group against
  the paged context, with a causal mask offset by the request's cached context: chunked prefill
  and prefix-cache hits.
"""

import triton
import triton.language as tl

from engine.kernels._pdl_triton import pdl_wait, prefetch_l2
from engine.kernels.cached_launch import CachedLaunch
from engine.kernels.triton_utils import triton_interpreting

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # engine/kv_cache.py FP8_MAX
FP8_MIN_SCALE: tl.constexpr = tl.constexpr(1e-12)  # engine/kv_cache.py FP8_MIN_SCALE
# The CPU interpreter (TRITON_INTERPRET=1, the tests) runs no inline PTX: Triton's own conversion there.
E4M3_PTX: tl.constexpr = tl.constexpr(not triton_interpreting())


@triton.jit
def _fp8_scale(amax):
    """A row's scale from its amax, as engine/kv_cache.py quantize."""
    return tl.maximum(amax / FP8_MAX, FP8_MIN_SCALE)


@triton.jit
def _to_fp8(x, scale, dtype: tl.constexpr):
    """x / scale in ``dtype`` (e4m3), clamped: amax / scale may round a hair above 448."""
    return tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX).to(dtype)


@triton.jit
def rope_store_kernel(
    Q, K, V, POS, COS_SIN, K_CACHE, V_CACHE, SLOT, K_SCALE, V_SCALE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_cslot, stride_ch,
    stride_sslot, stride_sh,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr, FP8: tl.constexpr,
):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cos = tl.load(COS_SIN + pos * stride_cs + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + j, mask=jm, other=0.0)[None, :]

    hq = tl.arange(0, HQ_PAD)[:, None]
    mq = (hq < HQ) & jm[None, :]
    q_ptr = Q + t * stride_qt + hq * stride_qh + j[None, :]
    q1 = tl.load(q_ptr, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=mq, other=0.0).to(tl.float32)
    tl.store(q_ptr, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=mq)
    tl.store(q_ptr + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=mq)

    hk = tl.arange(0, HKV_PAD)[:, None]
    mk = (hk < HKV) & jm[None, :]
    k_ptr = K + t * stride_kt + hk * stride_kh + j[None, :]
    k1 = tl.load(k_ptr, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    c_ptr = slot * stride_cslot + hk * stride_ch + j[None, :]
    k_lo = k1 * cos - k2 * sin
    k_hi = k2 * cos + k1 * sin
    v_ptr = V + t * stride_vt + hk * stride_vh + j[None, :]
    v_lo = tl.load(v_ptr, mask=mk, other=0.0).to(tl.float32)
    v_hi = tl.load(v_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    if FP8:  # each (token, head) row by its amax; padded lanes loaded 0 and do not move it
        s_ptr = slot * stride_sslot + tl.arange(0, HKV_PAD) * stride_sh
        smask = tl.arange(0, HKV_PAD) < HKV
        ks = _fp8_scale(tl.maximum(tl.max(tl.abs(k_lo), 1), tl.max(tl.abs(k_hi), 1)))
        vs = _fp8_scale(tl.maximum(tl.max(tl.abs(v_lo), 1), tl.max(tl.abs(v_hi), 1)))
        tl.store(K_SCALE + s_ptr, ks, mask=smask)
        tl.store(V_SCALE + s_ptr, vs, mask=smask)
        tl.store(K_CACHE + c_ptr, _to_fp8(k_lo, ks[:, None], K_CACHE.dtype.element_ty), mask=mk)
        tl.store(K_CACHE + c_ptr + HALF, _to_fp8(k_hi, ks[:, None], K_CACHE.dtype.element_ty), mask=mk)
        tl.store(V_CACHE + c_ptr, _to_fp8(v_lo, vs[:, None], V_CACHE.dtype.element_ty), mask=mk)
        tl.store(V_CACHE + c_ptr + HALF, _to_fp8(v_hi, vs[:, None], V_CACHE.dtype.element_ty), mask=mk)
    else:
        tl.store(K_CACHE + c_ptr, k_lo.to(K_CACHE.dtype.element_ty), mask=mk)
        tl.store(K_CACHE + c_ptr + HALF, k_hi.to(K_CACHE.dtype.element_ty), mask=mk)
        tl.store(V_CACHE + c_ptr, v_lo.to(V_CACHE.dtype.element_ty), mask=mk)
        tl.store(V_CACHE + c_ptr + HALF, v_hi.to(V_CACHE.dtype.element_ty), mask=mk)


@triton.jit
def _widen_e4m3(x):
    """An e4m3 tile as float16 (exact), four values a PTX block and two an instruction, by inline
    PTX the compiler cannot move into a dot's operand load (module docstring): the tile goes to
    shared memory as float16 and the dot reads it with ``ldmatrix.trans``. Four values a block: a
    32-bit register of the loaded tile (its first value in the low byte) goes to the block whole
    and comes back as two registers of float16 pairs, where two values a block split each loaded
    word into bytes and paired them again. Static, the device's Triton 3.6 for sm_90 (decode step
    kernel, engine/bench/experiments/fp8_attention_sass.py): its context loop 1,057 SASS
    instructions against 1,295 with two a block, 206 registers against 255 (the H100's own compile:
    206 and no spill, against 255 and 6 spills). Timed on the H100 (2026-12-07, the step's kernel,
    fused, engine/bench/experiments/fp8_kv_fused_decode_ab.py): 256 requests x 859 tokens 269.9
    against 280.7 us, 512 x 1,200 725.5 against 751.3 us. Kernel alone, 512 requests x 1,200
    tokens of an FP8 cache, Triton's own conversion against two values a block (engine/bench/experiments/fp8_kv_decode_anatomy.py, H100,
    2026-12-06): 753 against 677 us with two pipeline stages, 905 against 749 with three."""
    if E4M3_PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _load_kv(offs, end, d, b, kvh, K_CACHE, V_CACHE, BLOCK_TABLES, stride_bt, stride_kb, stride_ks, stride_kh,
             K_SCALE, V_SCALE, stride_sb, stride_ss, stride_sh, D: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr):
    """The cached K and V rows of the context positions ``offs`` (those < end; the rest read as
    zeros and cost no traffic), with an FP8 cache's per-row scales (otherwise unused stand-ins)."""
    valid = offs < end
    page = tl.load(BLOCK_TABLES + b * stride_bt + offs // PAGE, mask=valid, other=0).to(tl.int64)
    kv = page * stride_kb + (offs % PAGE) * stride_ks + kvh * stride_kh
    kvmask = valid[:, None] & (d < D)[None, :]
    k = tl.load(K_CACHE + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    v = tl.load(V_CACHE + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    if FP8:
        sc = page * stride_sb + (offs % PAGE) * stride_ss + kvh * stride_sh
        k_scale = tl.load(K_SCALE + sc, mask=valid, other=0.0)
        v_scale = tl.load(V_SCALE + sc, mask=valid, other=0.0)
    else:
        k_scale = offs.to(tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _attend_kv(q, acc, m_i, l_i, k, v, k_scale, v_scale, valid, scale, FP8: tl.constexpr):
    """Online softmax over one tile of loaded K/V rows (``valid`` ones count): the running
    output, max and sum updated (m_i may stay -inf only for a tile with no valid position)."""
    if FP8:
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * k_scale[None, :] * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:  # V's scales on p's columns, over the tile's largest (module docstring): p @ (v * scale)
        v_max = tl.maximum(tl.max(v_scale, 0), FP8_MIN_SCALE)
        p = p * (v_scale / v_max)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), _widen_e4m3(v)) * v_max
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(q, acc, m_i, l_i, offs, end, d, b, kvh, K_CACHE, V_CACHE, BLOCK_TABLES, stride_bt, stride_kb, stride_ks,
                 stride_kh, scale, K_SCALE, V_SCALE, stride_sb, stride_ss, stride_sh, D: tl.constexpr, PAGE: tl.constexpr,
                 FP8: tl.constexpr):
    """:func:`_load_kv` then :func:`_attend_kv` for the context positions ``offs`` (those < end)."""
    k, v, k_scale, v_scale = _load_kv(offs, end, d, b, kvh, K_CACHE, V_CACHE, BLOCK_TABLES, stride_bt, stride_kb, stride_ks,
                                      stride_kh, K_SCALE, V_SCALE, stride_sb, stride_ss, stride_sh, D, PAGE, FP8)
    return _attend_kv(q, acc, m_i, l_i, k, v, k_scale, v_scale, offs < end, scale, FP8)


@triton.jit
def _attend_new_token(q, acc, m_i, l_i, k_row, v_row, cos, sin, d, dmask, partner, owner, slot, kvh,
                      K_CACHE, V_CACHE, K_SCALE, V_SCALE, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
                      scale, D: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr):
    """A one-token decode row's new token: k rotated by (cos, sin), k and v as the cache stores
    them (FP8: attended as stored, the values later steps read); where ``owner`` (the split that
    owns the last position) written to the cache at ``slot`` and attended from registers."""
    k_f = (tl.load(k_row + d, mask=dmask, other=0.0).to(tl.float32) * cos
           + tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32) * sin)
    v_f = tl.load(v_row + d, mask=dmask, other=0.0).to(tl.float32)
    dst = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + kvh * stride_kh + d
    write = d < tl.where(owner, D, 0)  # dmask for the writer, nothing for the others
    if FP8:
        ks_new = _fp8_scale(tl.max(tl.abs(k_f), 0))
        vs_new = _fp8_scale(tl.max(tl.abs(v_f), 0))
        k_new = _to_fp8(k_f, ks_new, K_CACHE.dtype.element_ty)
        v_new = _to_fp8(v_f, vs_new, V_CACHE.dtype.element_ty)
        dst_s = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + kvh * stride_sh
        tl.store(K_SCALE + dst_s, ks_new, mask=owner)
        tl.store(V_SCALE + dst_s, vs_new, mask=owner)
        k_att = k_new.to(tl.float32) * ks_new
        v_att = v_new.to(tl.float32) * vs_new
    else:
        k_new = k_f.to(K_CACHE.dtype.element_ty)
        v_new = v_f.to(V_CACHE.dtype.element_ty)
        k_att = k_new.to(tl.float32)
        v_att = v_new.to(tl.float32)
    tl.store(K_CACHE + dst, k_new, mask=write)
    tl.store(V_CACHE + dst, v_new, mask=write)
    s_new = tl.sum(q.to(tl.float32) * k_att[None, :], 1) * scale
    s_new = tl.where(owner, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p_new = tl.exp(s_new - m_safe)
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v_att[None, :]
    return acc, m_new, l_i


@triton.jit
def _attend_new_rows(q, acc, m_i, l_i, K_NEW, V_NEW, stride_knt, stride_knh, stride_vnt, stride_vnh, b, kvh, pos, num_new,
                     COS_SIN, stride_cs, d, dmask, partner, slot, K_CACHE, V_CACHE, K_SCALE, V_SCALE,
                     stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh, scale,
                     D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, NEW_ROWS: tl.constexpr):
    """A row's new tokens of this step as one tile (a verifying row graph, ``ROW_GROUP`` > 1): tile
    row t is the token of the row t rows back (t < num_new; t = 0 the row's own), its k rotated
    by its position's RoPE, k and v as the cache stores them (FP8: attended as stored, per-token
    scales), attended from registers in one online-softmax update; the row's own token written to
    the cache at ``slot``. One tile instead of :func:`_attend_new_token` once a token: those ran
    one after another in the program that owns the last position, the kernel's longest."""
    t = tl.arange(0, NEW_ROWS)
    here = t < num_new
    lo = d < HALF
    j = tl.where(lo, d, d - HALF)
    at = tl.where(here, pos - t, pos)
    tile = here[:, None] & dmask[None, :]
    cos = tl.load(COS_SIN + at[:, None] * stride_cs + j[None, :], mask=tile, other=0.0).to(tl.float32)
    sin = (tl.load(COS_SIN + at[:, None] * stride_cs + HALF + j[None, :], mask=tile, other=0.0).to(tl.float32)
           * tl.where(lo, -1.0, 1.0)[None, :])
    rows = b - tl.where(here, t, 0)
    k_rows = K_NEW + rows[:, None] * stride_knt + kvh * stride_knh
    k_f = (tl.load(k_rows + d[None, :], mask=tile, other=0.0).to(tl.float32) * cos
           + tl.load(k_rows + partner[None, :], mask=tile, other=0.0).to(tl.float32) * sin)
    v_f = tl.load(V_NEW + rows[:, None] * stride_vnt + kvh * stride_vnh + d[None, :], mask=tile, other=0.0).to(tl.float32)
    own = t == 0
    dst = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + kvh * stride_kh + t[:, None] * 0 + d[None, :]
    write = own[:, None] & dmask[None, :]
    if FP8:
        k_scale = _fp8_scale(tl.max(tl.abs(k_f), 1))
        v_scale = _fp8_scale(tl.max(tl.abs(v_f), 1))
        k_new = _to_fp8(k_f, k_scale[:, None], K_CACHE.dtype.element_ty)
        v_new = _to_fp8(v_f, v_scale[:, None], V_CACHE.dtype.element_ty)
        dst_s = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + kvh * stride_sh + t * 0
        tl.store(K_SCALE + dst_s, k_scale, mask=own)
        tl.store(V_SCALE + dst_s, v_scale, mask=own)
    else:
        k_new = k_f.to(K_CACHE.dtype.element_ty)
        v_new = v_f.to(V_CACHE.dtype.element_ty)
        k_scale = at.to(tl.float32)  # unused stand-ins
        v_scale = k_scale
    tl.store(K_CACHE + dst, k_new, mask=write)
    tl.store(V_CACHE + dst, v_new, mask=write)
    return _attend_kv(q, acc, m_i, l_i, k_new, v_new, k_scale, v_scale, here, scale, FP8)


@triton.jit(do_not_specialize=["stride_bt", "stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh", "NUM_SPLITS"])
def split_kv_decode_attention(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, OUT, O_PART, LSE_PART,
    K_NEW, V_NEW, POS, COS_SIN, SLOT, K_SCALE, V_SCALE,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_out_t, stride_out_h,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs, stride_sb, stride_ss, stride_sh,
    scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS, USE_PDL: tl.constexpr,
    FUSED_ROPE: tl.constexpr, HALF: tl.constexpr, SMALL_TILE: tl.constexpr, FP8: tl.constexpr, KV_LINE: tl.constexpr = 0,
    KV_LINES: tl.constexpr = 1, KV_PRELOAD: tl.constexpr = False, ROW_GROUP: tl.constexpr = 1,
    NEW_ROWS: tl.constexpr = 16,
):
    """FUSED_ROPE: Q, K_NEW, V_NEW are this step's raw q|k|v (the request's last token): the
    kernel rotates q and k by POS itself, the split that owns the last position writes k and v to
    the cache at SLOT and attends to them from registers (the cache read never meets its own
    write) - no rope_store kernel in a decode step. KV_LINE > 0 (with USE_PDL and FUSED_ROPE:
    cache elements a 128-byte line, KV_LINES of them a row): the slice's first SMALL_TILE cached K and V rows are asked
    into L2 before the PDL wait - earlier steps wrote them, and no kernel in flight writes them.
    KV_PRELOAD (with FUSED_ROPE): a short slice's one tile of cached K/V is loaded into registers
    before the wait (with PDL), for the same reason.
    ROW_GROUP > 1 (with FUSED_ROPE): rows may be successive tokens of one request, in position
    order (a verifying step's row graph), up to ROW_GROUP of them. A row's request's positions
    that the up to ROW_GROUP - 1 rows before it write in this step (the row before holds position
    - 1 and writes the slot that position has in this row's block table, and so on back) are
    attended from those rows' raw k and v, rotated here, like the row's own token, and never read
    from the cache, which those rows write in the same kernel: one tile of NEW_ROWS (a power of
    two >= ROW_GROUP, 16 at least for the dot) by the split that owns the last position."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata (lengths, positions, slots) and the RoPE table were written before the
    # step's first kernel: read before the PDL wait, off the critical path.
    seq_len = tl.load(SEQ_LENS + b)
    # Slices in SMALL_TILE steps: a short one is one SMALL_TILE tile (more splits busy at short
    # contexts), a longer one TILE_N tiles, the last part masked.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), SMALL_TILE) * SMALL_TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < D)[None, :]
    q_row = Q + b * stride_qt + heads[:, None] * stride_qh
    if FUSED_ROPE:  # rotate-half RoPE: x[d] * cos[d % HALF] -/+ x[d +/- HALF] * sin[d % HALF]
        dmask = d < D
        lo = d < HALF
        j = tl.where(lo, d, d - HALF)
        partner = tl.where(lo, d + HALF, d - HALF)
        pos = tl.load(POS + b).to(tl.int64)
        slot = tl.load(SLOT + b).to(tl.int64)
        cos = tl.load(COS_SIN + pos * stride_cs + j, mask=dmask, other=0.0).to(tl.float32)
        sin = tl.load(COS_SIN + pos * stride_cs + HALF + j, mask=dmask, other=0.0).to(tl.float32) * tl.where(lo, -1.0, 1.0)
        num_new = 1  # positions attended from this step's raw k/v: the row's own, and its request's rows before it
        following = True
        for back in tl.static_range(1, ROW_GROUP):  # rows back from this one
            ok = following & (b >= back) & (pos >= back)
            prev = tl.where(ok, b - back, b)
            want = tl.where(ok, pos - back, pos)
            blk = tl.load(BLOCK_TABLES + b * stride_bt + want // PAGE, mask=ok, other=-1).to(tl.int64)
            following = (ok & (tl.load(POS + prev, mask=ok, other=-1).to(tl.int64) == want)
                         & (tl.load(SLOT + prev, mask=ok, other=-1).to(tl.int64) == blk * PAGE + want % PAGE))
            num_new += following.to(tl.int32)
        last = end == seq_len  # this split owns the last position: the token being decoded
        owner = (start < end) & last
        end = tl.minimum(end, seq_len - num_new)  # the cache holds every position before the new ones
        if USE_PDL and KV_LINE > 0:
            offs = start + tl.arange(0, SMALL_TILE)
            ok = offs < end
            page = tl.load(BLOCK_TABLES + b * stride_bt + offs // PAGE, mask=ok, other=0).to(tl.int64)
            rows = page * stride_kb + (offs % PAGE) * stride_ks + kvh * stride_kh
            line_offs = tl.minimum(tl.arange(0, KV_LINES) * KV_LINE, D - 1)  # a row's line starts
            ptrs = tl.where(ok, rows, 0)[:, None] + line_offs[None, :]
            prefetch_l2(K_CACHE + ptrs)
            prefetch_l2(V_CACHE + ptrs)
        if KV_PRELOAD:  # a short slice's tile (none for a long one: end 0 masks every row)
            pre_offs = start + tl.arange(0, SMALL_TILE)
            pre_end = tl.where((per_split <= SMALL_TILE) & (start < end), end, 0)
            k0, v0, k0_scale, v0_scale = _load_kv(pre_offs, pre_end, d, b, kvh, K_CACHE, V_CACHE, BLOCK_TABLES, stride_bt,
                                                  stride_kb, stride_ks, stride_kh, K_SCALE, V_SCALE, stride_sb, stride_ss,
                                                  stride_sh, D, PAGE, FP8)
    pdl_wait(USE_PDL)
    if FUSED_ROPE:
        q = (tl.load(q_row + d[None, :], mask=qmask, other=0.0).to(tl.float32) * cos[None, :]
             + tl.load(q_row + partner[None, :], mask=qmask, other=0.0).to(tl.float32) * sin[None, :]).to(Q.dtype.element_ty)
    else:
        q = tl.load(q_row + d[None, :], mask=qmask, other=0.0)
    if FP8:  # the dots in float16: e4m3 widens to it pairwise (module docstring)
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    short = (per_split <= SMALL_TILE) & (start < end)  # a short slice: one narrow tile
    if FUSED_ROPE and KV_PRELOAD:
        if short:  # the tile loaded before the wait
            acc, m_i, l_i = _attend_kv(q, acc, m_i, l_i, k0, v0, k0_scale, v0_scale, pre_offs < end, scale, FP8)
    else:
        if short:
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start + tl.arange(0, SMALL_TILE), end, d, b, kvh, K_CACHE, V_CACHE,
                                         BLOCK_TABLES, stride_bt, stride_kb, stride_ks, stride_kh, scale,
                                         K_SCALE, V_SCALE, stride_sb, stride_ss, stride_sh, D, PAGE, FP8)
    for n0 in range(start, tl.where(short, start, end), TILE_N):  # a long slice in wide tiles
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0 + tl.arange(0, TILE_N), end, d, b, kvh, K_CACHE, V_CACHE,
                                     BLOCK_TABLES, stride_bt, stride_kb, stride_ks, stride_kh, scale,
                                     K_SCALE, V_SCALE, stride_sb, stride_ss, stride_sh, D, PAGE, FP8)
    if FUSED_ROPE:  # the new tokens: the row's own written to the cache for later steps; all attended from registers
        if ROW_GROUP == 1:
            acc, m_i, l_i = _attend_new_token(q, acc, m_i, l_i, K_NEW + b * stride_knt + kvh * stride_knh,
                                              V_NEW + b * stride_vnt + kvh * stride_vnh, cos, sin, d, dmask, partner,
                                              owner, slot, kvh, K_CACHE, V_CACHE, K_SCALE, V_SCALE,
                                              stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh, scale, D, PAGE, FP8)
        else:
            if owner:
                acc, m_i, l_i = _attend_new_rows(q, acc, m_i, l_i, K_NEW, V_NEW, stride_knt, stride_knh, stride_vnt, stride_vnh,
                                                 b, kvh, pos, num_new, COS_SIN, stride_cs, d, dmask, partner, slot, K_CACHE,
                                                 V_CACHE, K_SCALE, V_SCALE, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                                 stride_sh, scale, D, HALF, PAGE, FP8, NEW_ROWS)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    omask = (g < GROUP)[:, None] & (d < D)[None, :]
    if NUM_SPLITS == 1:  # the whole context: the final output, no combine pass (a runtime branch)
        tl.store(OUT + b * stride_out_t + heads[:, None] * stride_out_h + d[None, :], out.to(OUT.dtype.element_ty), mask=omask)
    else:
        tl.store(O_PART + b * stride_ot + heads[:, None] * stride_oh + split * stride_os + d[None, :], out, mask=omask)
        tl.store(LSE_PART + b * stride_lt + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit(do_not_specialize=["stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh", "NUM_SPLITS"])
def combine_kernel(
    O_PART, LSE_PART, OUT,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_out_t, stride_out_h,
    NUM_SPLITS, SPLITS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    lse = tl.load(LSE_PART + b * stride_lt + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    o = tl.load(O_PART + b * stride_ot + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=smask[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * stride_out_t + h * stride_out_h + d, out.to(OUT.dtype.element_ty), mask=d < D)


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _prefill_block(
    acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, n0, hi, q_pos, d, qk_scale,
    stride_kb, stride_ks, K_SCALE, V_SCALE, scale_head, stride_sb, stride_ss,
    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr,
):
    """One BLOCK_N slice of keys for a tile of rows; m_i is in base 2 (scores times qk_scale =
    softmax scale x log2(e), applied in float32 inside the exponent's FMA).
    MASKED=False is the hot path: keys every row of the tile may see, all inside the context, so
    no causal mask, no bounds masks and no -inf guards (most of a long context)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    if MASKED:
        page = tl.load(table + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        kvmask = n_valid[:, None] & (d < D)[None, :]
    else:
        page = tl.load(table + offs_n // PAGE).to(tl.int64)
        kvmask = (d < D)[None, :]  # only read when the head dim is padded
    kv = page * stride_kb + (offs_n % PAGE) * stride_ks + kv_head
    if D == D_PAD and not MASKED:
        k = tl.load(K_CACHE + kv[:, None] + d[None, :])
    else:
        k = tl.load(K_CACHE + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    if FP8:  # e4m3 widened to float16 for the dot; K's scales on the score columns
        sc = page * stride_sb + (offs_n % PAGE) * stride_ss + scale_head
        if MASKED:
            k_scale = tl.load(K_SCALE + sc, mask=n_valid, other=0.0)
            v_scale = tl.load(V_SCALE + sc, mask=n_valid, other=0.0)
        else:
            k_scale = tl.load(K_SCALE + sc)
            v_scale = tl.load(V_SCALE + sc)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * k_scale[None, :]
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = m_new
    if MASKED:  # a row may have seen no key yet: keep exp2 away from (-inf) - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if D == D_PAD and not MASKED:
        v = tl.load(V_CACHE + kv[:, None] + d[None, :])
    else:
        v = tl.load(V_CACHE + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    if FP8:  # V's scales on p's columns, over the tile's largest (module docstring)
        v_max = tl.maximum(tl.max(v_scale, 0), FP8_MIN_SCALE)
        p = p * (v_scale / v_max)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), _widen_e4m3(v)) * v_max
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_bt", "stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh", "NUM_SPLITS"])
def prefill_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, QUERY_START, TILE_REQ, TILE_START, OUT, O_PART, LSE_PART, K_SCALE, V_SCALE,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_out_t, stride_out_h,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_sb, stride_ss, stride_sh,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS, FP8: tl.constexpr,
):
    """One program: BLOCK_M rows of one request and one KV head, over one slice of the context.
    Rows pack the GQA group: row m is query ``m // GROUP`` of query head ``kvh*GROUP + m % GROUP``,
    so every K/V tile loaded serves all heads that share it. With NUM_SPLITS > 1 the slices'
    partial results go to O_PART/LSE_PART for combine_kernel (a short question after a long
    cached prefix has few rows, so the context is what gets spread over the GPU).

    The slice runs in two loops: keys that every row of the tile sees (all of a cached prefix,
    and the chunk's own keys before the tile's first query) without any mask, then the causal
    diagonal with masks. The softmax runs in base 2 (exp2: one instruction)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.load(TILE_REQ + tile).to(tl.int64)
    row0 = tl.load(TILE_START + tile)
    q_begin = tl.load(QUERY_START + r).to(tl.int64)
    q_len = tl.load(QUERY_START + r + 1) - q_begin
    seq_len = tl.load(SEQ_LENS + r)
    ctx = seq_len - q_len

    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, D_PAD)
    m_valid = qi < q_len
    qmask = m_valid[:, None] & (d < D)[None, :]
    tok = q_begin + qi
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if FP8:  # the dots in float16: e4m3 widens to it pairwise (module docstring)
        q = q.to(tl.float16)
    q_pos = ctx + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    hi = tl.minimum(seq_len, ctx + (row0 + BLOCK_M - 1) // GROUP + 1)  # causal bound of the whole tile
    per_split = tl.cdiv(tl.cdiv(hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, hi)
    seen_by_all = tl.minimum(ctx + row0 // GROUP + 1, hi)  # keys before it: no row of the tile masks them
    mid = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    table = BLOCK_TABLES + r * stride_bt
    kv_head = kvh * stride_kh
    scale_head = kvh * stride_sh
    qk_scale = scale * LOG2E
    for n0 in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = _prefill_block(acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, n0, hi, q_pos, d, qk_scale,
                                       stride_kb, stride_ks, K_SCALE, V_SCALE, scale_head, stride_sb, stride_ss,
                                       D, D_PAD, PAGE, BLOCK_N, False, FP8)
    for n0 in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _prefill_block(acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, n0, hi, q_pos, d, qk_scale,
                                       stride_kb, stride_ks, K_SCALE, V_SCALE, scale_head, stride_sb, stride_ss,
                                       D, D_PAD, PAGE, BLOCK_N, True, FP8)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # a runtime branch: split counts never trigger a recompile
        tl.store(OUT + tok[:, None] * stride_out_t + head[:, None] * stride_out_h + d[None, :], out.to(OUT.dtype.element_ty), mask=qmask)
    else:  # combine_kernel merges in natural log: lse = ln(l) + m * ln(2)
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(O_PART + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :], out, mask=qmask)
        tl.store(LSE_PART + tok * stride_lt + head * stride_lh + split, lse, mask=m_valid)


# What triton_paged launches: these run eagerly between the piecewise graphs of mixed steps, where
# the JIT's per-launch dispatch was most of a step's host time (engine/kernels/cached_launch.py).
rope_store_launch = CachedLaunch(rope_store_kernel)
decode_launch = CachedLaunch(split_kv_decode_attention)
combine_launch = CachedLaunch(combine_kernel)
prefill_launch = CachedLaunch(prefill_kernel)
