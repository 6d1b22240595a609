"""The Triton attention backend: fused RoPE + cache write, split-KV decode, paged prefill."""

from __future__ import annotations

import torch

from dataclasses import dataclass

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.kernels.triton_utils import launch_options
from engine.kv_cache import LayerKV
from engine.transfer import to_device

# Context tokens per decode iteration (a multiple of the page size or a divisor). 128 against 64,
# kernel alone on the 8B's shape (engine/bench/experiments/fp8_kv_decode_ab.py, H100, 2026-12-06):
# bf16 cache 10-12% faster from 32 requests up (512 x 1,200 tokens: 856 against 971 us), the
# same at batch 1; an FP8 cache 1.3-1.4x faster (818 against 1,155 us), its loads too narrow at 64.
DECODE_TILE = 128
# Software-pipeline stages of the decode loop over an FP8 cache (bf16 keeps Triton's default, 3).
# Kernel alone, 512 x 1,200 tokens (engine/bench/experiments/fp8_kv_decode_anatomy.py, H100,
# 2026-12-06): 677 us with 2 stages, 741 with 1, 749 with 3 or 4 (at 3 the loop spills registers).
DECODE_FP8_STAGES = 2
# Split slices come in steps of this many tokens, and a slice this short is one tile of it: at
# short contexts more splits get work (batch 1 at ~580 tokens: 19 busy splits instead of 10),
# long slices keep the wide tile (``python -m engine.bench.kernels --decode-tiles``).
DECODE_SMALL_TILE = 32
# With PDL and the fused RoPE + KV write, decode attention may ask L2 for its slice's first cached
# K/V rows before waiting for the q|k|v projection (split_kv_decode_attention's KV_LINE), or load
# a short slice's one tile of them into registers then (KV_PRELOAD). Batch-1 graph replay of the
# Qwen2.5-1.5B shape (engine/bench/experiments/bs1_prefetch_ab.py --kv, three rounds, H100,
# 2026-12-05): preload alone 1.513 ms, prefetch and preload 1.524, prefetch alone 1.552, neither
# 1.563. engine.bench latency on that H100, alternating: 1.5B 642.8 / 643.8 tok/s with preload
# against 626.2 / 625.0 with prefetch; 8B 181.9 against 179.9. (On an H200 the prefetch had
# beaten neither, 1.297 against 1.310 ms; preload has not run there yet.)
DECODE_KV_PREFETCH = False
DECODE_KV_PRELOAD = True
# A row graph's verifying step (rows that are successive tokens of one request) in the fused decode
# kernel too: each row attends to its request's new keys of the rows before it from their raw k|v
# (split_kv_decode_attention's ROW_GROUP), instead of RoPE + the KV write as a kernel of its own
# before attention in every layer. Those new tokens are one tile of the split that owns the last
# position (_attend_new_rows). 1.5B shape, random weights, H100, device speculation steps at 2,160
# tokens of context (engine/bench/experiments/device_step_cost.py, two rounds, 2026-12-07 22:48):
# k=4 1.727 ms a step fused against 1.761 not, k=8 1.864 against 1.868. When the kernel attended
# the new tokens one after another, it lost from k=4 up (k=4 1.879 against 1.846, 16:31 the same
# day, verify_step_anatomy.py).
FUSE_ROW_KV_WRITE = True


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape of the paged prefill kernel (measured by ``python -m engine.bench.kernels``)."""

    # H200 (docs/performance.md, 2026-11-30 ~03:30): with the unmasked main loop 128x128 tiles, 8
    # warps, 3 or 4 stages were fastest for chunks of 96-480 queries after 32k context and for a
    # fresh 8 x 2,048 prefill (128x64 and 64x64 10-25% slower); 4 stages was 2x slower once on a
    # 30-query chunk, so 3.
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


PREFILL = PrefillConfig()
# An FP8 cache's tiles are widened to float16 in registers before each dot: narrower query tiles
# in fewer stages (engine/bench/experiments/prefill_tiles_by_cache.py, H100, 2026-12-06): fresh
# 27 x 600-token prompts 771 against 2,239 us with PREFILL's shape, 8 x 2,048 1,436 against
# 3,274, 480 queries after 31,520 tokens 1,205 against 2,218 (bf16's best stays PREFILL's).
PREFILL_FP8 = PrefillConfig(64, 128, 4, 2)
TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H100/H200: enough splits to fill the GPU
MAX_SPLITS = 32  # split counts are runtime values padded to this: no recompiles as contexts grow


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (max(n, 1) - 1).bit_length())


def scale_args(kv_cache: LayerKV) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """An FP8 cache's K and V scales and their (block, row, head) strides; for a plain cache the
    K cache twice and zero strides, which the kernels (FP8=False) never read."""
    if kv_cache.k_scale is None or kv_cache.v_scale is None:
        return kv_cache.k, kv_cache.k, 0, 0, 0
    return kv_cache.k_scale, kv_cache.v_scale, *kv_cache.k_scale.stride()


def decode_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Context splits per (request, KV head): a function of the batch shape only, so a CUDA
    graph captured for a batch size stays valid whatever the context lengths are."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))


def rope_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    kv_cache: LayerKV, slot_mapping: torch.Tensor, *, pdl: bool = False,
) -> torch.Tensor:
    """``pdl``: launch with programmatic dependent launch (Hopper+, engine/kernels/_pdl_triton.py)."""
    from engine.attention._triton_kernels import rope_store_launch

    k_cache, v_cache = kv_cache.k, kv_cache.v
    t, hq, dim = q.shape
    hkv = k.shape[1]
    half = dim // 2
    kc = k_cache.view(-1, hkv, dim)
    vc = v_cache.view(-1, hkv, dim)
    k_scale, v_scale, *_ = scale_args(kv_cache)
    if kv_cache.quantized:  # per slot, as the cache is viewed
        k_scale, v_scale = k_scale.view(-1, hkv), v_scale.view(-1, hkv)
    stride_sslot, stride_sh = (k_scale.stride(0), k_scale.stride(1)) if kv_cache.quantized else (0, 0)
    rope_store_launch[(t,)](
        q, k, v, positions, cos_sin, kc, vc, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        kc.stride(0), kc.stride(1), stride_sslot, stride_sh,
        HQ=hq, HKV=hkv, HALF=half, HQ_PAD=_pow2(hq), HKV_PAD=_pow2(hkv), HALF_PAD=_pow2(half), USE_PDL=pdl,
        FP8=kv_cache.quantized, **launch_options(pdl),
    )
    return q


@dataclass(frozen=True)
class NewTokens:
    """A decode step's raw k and v [B, Hkv, D] (the last token of each request), its positions,
    the RoPE table and its cache slots: what :func:`decode_attention` needs to do RoPE and the KV
    write itself."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


def decode_attention(
    q: torch.Tensor, kv_cache: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out: torch.Tensor, *, pdl: bool = False, new: NewTokens | None = None, tile_n: int = 0, small_tile: int = 0,
    num_warps: int = 4, row_group: int = 1,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per request) -> out [B, Hq, D]; ``pdl`` as in :func:`rope_and_store`.

    ``new``: q is not rotated yet and the requests' last tokens are not in the cache: the kernel
    applies RoPE to q and k and writes k and v (one kernel instead of rope_and_store + this);
    ``row_group`` > 1: rows may be up to this many successive tokens of one request, in position
    order (``AttentionMetadata.rows_are_tokens``), each attending to the new keys of its request's
    rows before it from ``new``'s raw k and v.
    ``tile_n`` / ``small_tile``: the context tiles, default ``DECODE_TILE`` / ``DECODE_SMALL_TILE``
    (``python -m engine.bench.kernels --decode-tiles`` sweeps others); ``num_warps``: a program's
    warps (4; 8 was slower for either cache dtype, engine/bench/experiments/fp8_kv_decode_ab.py)."""
    from engine.attention._triton_kernels import combine_launch, decode_launch

    k_cache, v_cache = kv_cache.k, kv_cache.v
    k_scale, v_scale, stride_sb, stride_ss, stride_sh = scale_args(kv_cache)
    b, hq, dim = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    splits = decode_splits(b, hkv)
    # float32 partials only when split (a dummy otherwise: one kernel signature, one compile)
    shape = (b, hq, splits, dim) if splits > 1 else (1, 1, 1, 1)
    o_part = torch.empty(shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(shape[:3], dtype=torch.float32, device=q.device)
    d_pad = _pow2(dim, 16)
    line = 128 // k_cache.element_size()  # cache elements a 128-byte line
    k_new, v_new, positions, cos_sin, slots = (new.k, new.v, new.positions, new.cos_sin, new.slot_mapping) if new else (q, q, seq_lens, q, seq_lens)
    decode_launch[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse,
        k_new, v_new, positions, cos_sin, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos_sin.stride(0), stride_sb, stride_ss, stride_sh,
        scale,
        GROUP=group, GROUP_PAD=_pow2(group, 16), D=dim, D_PAD=d_pad, PAGE=page, TILE_N=tile_n or DECODE_TILE, NUM_SPLITS=splits,
        SMALL_TILE=small_tile or DECODE_SMALL_TILE,
        USE_PDL=pdl, FUSED_ROPE=new is not None, HALF=dim // 2, FP8=kv_cache.quantized,
        KV_LINE=line if pdl and new is not None and DECODE_KV_PREFETCH else 0, KV_LINES=_pow2(-(-dim // line)),
        KV_PRELOAD=new is not None and DECODE_KV_PRELOAD, ROW_GROUP=row_group if new is not None else 1,
        NEW_ROWS=max(16, _pow2(row_group)),
        num_warps=num_warps, **({"num_stages": DECODE_FP8_STAGES} if kv_cache.quantized else {}), **launch_options(pdl),
    )
    if splits == 1:
        return out
    combine_launch[(b, hq)](
        o_part, lse, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=MAX_SPLITS, D=dim, D_PAD=d_pad, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def prefill_tiles(
    query_lens: list[int], seq_lens: list[int], first: int, block_m: int, group: int
) -> tuple[list[int], list[int]]:
    """(request index, first row) of every BLOCK_M tile of (query, head-in-group) rows of the
    requests from ``first`` on, heaviest first: a tile attends to the keys up to its last row's
    position, and launching the longest tiles in the first wave keeps a causal prefill's
    critical path at one long tile instead of a wave plus one (longest-processing-time-first)."""
    tiles = []
    for i in range(first, len(query_lens)):
        ctx = seq_lens[i] - query_lens[i]
        for m0 in range(0, query_lens[i] * group, block_m):
            keys = ctx + min(query_lens[i], (m0 + block_m - 1) // group + 1)
            tiles.append((-keys, i, m0))
    tiles.sort()
    return [i for _, i, _ in tiles], [m0 for _, _, m0 in tiles]


def prefill_splits(num_programs: int, max_context: int) -> int:
    """Split the context when too few (tile, head) programs would fill the GPU."""
    if num_programs >= TARGET_PROGRAMS // 2 or max_context < 256:
        return 1
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // num_programs), max_context // 256))


def prefill_attention(
    q: torch.Tensor, kv_cache: LayerKV, meta: AttentionMetadata, scale: float, out: torch.Tensor,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Attention for the prefill requests of the batch (those after the decodes); ``config`` the
    tile shape, by default PREFILL_FP8 for an FP8 cache and PREFILL otherwise."""
    from engine.attention._triton_kernels import combine_launch, prefill_launch

    config = config or (PREFILL_FP8 if kv_cache.quantized else PREFILL)

    k_cache, v_cache = kv_cache.k, kv_cache.v
    k_scale, v_scale, stride_sb, stride_ss, stride_sh = scale_args(kv_cache)
    t, hq, dim = q.shape
    hkv = k_cache.shape[2]
    key = ("prefill_tiles", config.block_m)
    tiles = meta.scratch.get(key)
    if tiles is None:
        reqs, starts = prefill_tiles(meta.query_lens_host, meta.seq_lens_host, meta.num_decodes, config.block_m, hq // hkv)
        tiles = (to_device(reqs, torch.int32, q.device), to_device(starts, torch.int32, q.device))
        meta.scratch[key] = tiles
    tile_req, tile_start = tiles
    if tile_req.numel() == 0:
        return out
    splits = prefill_splits(tile_req.numel() * hkv, meta.max_seq_len)
    d_pad = _pow2(dim, 16)
    # float32 partials in both cases: same kernel signature, so one compiled kernel for both
    shape = (t, hq, splits, dim) if splits > 1 else (1, 1, 1, 1)
    o_part = torch.empty(shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(shape[:3], dtype=torch.float32, device=q.device)
    prefill_launch[(tile_req.numel(), hkv, splits)](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tile_req, tile_start, out, o_part, lse,
        k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1), stride_sb, stride_ss, stride_sh,
        scale,
        GROUP=hq // hkv, D=dim, D_PAD=d_pad, PAGE=k_cache.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        NUM_SPLITS=splits, FP8=kv_cache.quantized, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        first = meta.num_decodes  # decode rows come first, one token each
        combine_launch[(t - first, hq)](
            o_part[first:], lse[first:], out[first:],
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=MAX_SPLITS, D=dim, D_PAD=d_pad, USE_PDL=False,
        )
    return out


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def rope_and_store(self, q, k, v, positions, cos_sin, kv_cache, meta, pdl=False):  # type: ignore[override]
        return rope_and_store(q, k, v, positions, cos_sin, kv_cache, meta.slot_mapping, pdl=pdl)

    def rope_store_attend(self, q, k, v, positions, cos_sin, kv_cache, meta, scale, pdl=False):  # type: ignore[override]
        if meta.num_decodes < meta.num_requests or (meta.rows_are_tokens and not FUSE_ROW_KV_WRITE):
            return super().rope_store_attend(q, k, v, positions, cos_sin, kv_cache, meta, scale, pdl)  # RoPE + write first
        out = torch.empty_like(q)  # decode rows: one kernel per layer does RoPE, the KV write and attention
        new = NewTokens(k, v, positions, cos_sin, meta.slot_mapping)
        return decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, out, pdl=pdl, new=new,
                                row_group=meta.row_group)

    def attend(self, q, kv_cache, meta, scale, pdl=False):  # type: ignore[override]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            decode_attention(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out[:nd], pdl=pdl)
        if nd < meta.num_requests:
            prefill_attention(q, kv_cache, meta, scale, out)
        return out
