"""Pure-torch paged attention: gather each request's KV blocks, then SDPA.

This is the CPU path and the reference GPU kernels are tested against. Decodes (one query each)
run as one batched SDPA over padded contexts; prefill chunks run one SDPA per request with a
causal mask offset by the request's cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.kv_cache import LayerKV, dequantize, quantize


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots (an FP8 cache: e4m3 values and each
    (token, head) row's scale)."""
    for x, cache, scales in ((k, kv_cache.k, kv_cache.k_scale), (v, kv_cache.v, kv_cache.v_scale)):
        if scales is None:
            cache.view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            values, scale = quantize(x)  # copied as bytes: index_copy_ has no e4m3 kernel on the CPU
            cache.view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, values.view(torch.uint8))
            scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, scale)


def gather_blocks(cache: torch.Tensor, table: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks ``table`` (flat, ``rows`` requests) of a [blocks, page, H, D] cache as
    [rows, tokens, H, D]. ``index_select`` on whole blocks copies contiguous rows, several
    times faster on the CPU than advanced indexing."""
    page, heads, dim = cache.shape[1:]
    flat = cache.view(cache.shape[0], -1).index_select(0, table.to(torch.long))
    return flat.view(rows, -1, heads, dim)


def gather_kv(kv_cache: LayerKV, table: torch.Tensor, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks ``table`` as in :func:`gather_blocks`; an FP8 cache's dequantized to
    ``dtype`` (a plain cache's stay in its dtype: the caller converts where it needs to)."""
    if kv_cache.k_scale is None or kv_cache.v_scale is None:
        return gather_blocks(kv_cache.k, table, rows), gather_blocks(kv_cache.v, table, rows)
    # gathered as bytes: index_select has no e4m3 kernel on the CPU
    keys = gather_blocks(kv_cache.k.view(torch.uint8), table, rows).view(kv_cache.k.dtype)
    values = gather_blocks(kv_cache.v.view(torch.uint8), table, rows).view(kv_cache.v.dtype)
    heads = kv_cache.k.shape[2]
    idx = table.to(torch.long)
    k_scale = kv_cache.k_scale.view(kv_cache.k_scale.shape[0], -1).index_select(0, idx).view(rows, -1, heads)
    v_scale = kv_cache.v_scale.view(kv_cache.v_scale.shape[0], -1).index_select(0, idx).view(rows, -1, heads)
    return dequantize(keys, k_scale, dtype), dequantize(values, v_scale, dtype)


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every query over its request's cached context (KV already written)."""
    block_size = kv_cache.k.shape[1]
    nd = meta.num_decodes
    if nd:
        # Decodes (one query each) as one batched SDPA over contexts padded to the longest.
        # The gather index and padding mask are the same for every layer: built once per step.
        decode = meta.scratch.get("decode")
        if decode is None:
            lens = meta.seq_lens_host[:nd]
            max_len = max(lens)
            table = meta.block_tables[:nd, : -(-max_len // block_size)].reshape(-1).to(torch.long)
            mask = None
            if min(lens) != max_len:
                mask = (torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]
            decode = meta.scratch["decode"] = (table, max_len, mask)
        table, max_len, mask = decode
        keys, values = gather_kv(kv_cache, table, nd, q.dtype)
        keys, values = keys[:, :max_len].transpose(1, 2), values[:, :max_len].transpose(1, 2)  # [nd, Hkv, L, D]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)
        if nd == meta.num_requests:
            return o
    out = torch.empty_like(q)
    if nd:
        out[:nd] = o
    start = nd
    chunks = meta.scratch.get("chunk_views", {})
    for i in range(nd, meta.num_requests):
        qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
        if i in chunks:
            out[start : start + qlen] = chunk_attention_views(q[start : start + qlen], kv_cache, *chunks[i], scale)
            start += qlen
            continue
        nblocks = -(-slen // block_size)
        table = meta.block_tables[i, :nblocks]
        keys, values = gather_kv(kv_cache, table, 1, q.dtype)
        keys = keys[0, :slen].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        values = values[0, :slen].transpose(0, 1).unsqueeze(0)
        qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
        if qlen == slen:
            o = F.scaled_dot_product_attention(qi, keys.to(q.dtype), values.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at position slen - qlen + j and sees keys 0..that position.
            qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.arange(slen, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qi, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
        start += qlen
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's "rotate_half" layout; cos/sin [T, 1, D/2] broadcast over heads."""
    return rotate_signed(x, *signed_cos_sin(cos, sin))


def signed_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos | cos] and [-sin | sin] over the full head dim: RoPE becomes two multiplies and an add."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate_signed(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """x * [cos | cos] + [x2 | x1] * [-sin | sin]  ==  [x1 cos - x2 sin | x2 cos + x1 sin]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos2, torch.cat((x2, x1), dim=-1), sin2)


MAX_VIEW_DECODES = 4  # decode-only steps of up to this many requests read the cache through views
MAX_VIEW_RUNS = 4  # ... when each request's blocks form at most this many runs of consecutive ids


def block_runs(blocks: list[int], tokens: int, page: int) -> list[tuple[int, int, int]]:
    """(first block, blocks, tokens) of each run of consecutive block ids covering ``tokens``."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks[: -(-tokens // page)]):
        n = min(page, tokens - i * page)
        if runs and runs[-1][0] + runs[-1][1] == b:
            first, count, have = runs[-1]
            runs[-1] = (first, count + 1, have + n)
        else:
            runs.append((b, 1, n))
    return runs


def decode_view_plan(meta: AttentionMetadata, page: int) -> list[list[tuple[int, int, int]]] | None:
    """Per decode request its block runs, or None when the step is not a small decode-only step
    with few runs per request (then the gathering reference runs)."""
    nd = meta.num_decodes
    if nd != meta.num_requests or nd > MAX_VIEW_DECODES:
        return None
    tables = meta.block_tables[:nd].tolist()
    plan = [block_runs(t, n, page) for t, n in zip(tables, meta.seq_lens_host[:nd])]
    return plan if all(len(r) <= MAX_VIEW_RUNS for r in plan) else None


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's (output, log-sum-exp of its
    scores): outputs weighted by their share of the total softmax mass, in float32."""
    w = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)[..., None]  # [parts, ..., rows, 1]
    return sum(w[r] * o.float() for r, (o, _) in enumerate(parts))


def decode_attention_views(q: torch.Tensor, kv_cache: LayerKV, plan: list[list[tuple[int, int, int]]], scale: float) -> torch.Tensor:
    """Decode attention reading K/V in place: each run of consecutive blocks is a strided view of
    the cache, not a gathered copy (at 2.6k context on the CPU: 186 vs 441 µs a layer). The
    query's GQA group becomes the query axis of its KV head, so one SDPA call serves the group;
    runs are merged by their log-sum-exp. A plain (not FP8) cache only."""
    k_cache, v_cache = kv_cache.k, kv_cache.v
    heads, dim = k_cache.shape[2:]
    group = q.shape[1] // heads
    out = torch.empty_like(q)
    for i, runs in enumerate(plan):
        qi = q[i].view(1, heads, group, dim)
        parts = []
        for first, count, tokens in runs:
            k = k_cache[first : first + count].view(1, -1, heads, dim)[:, :tokens].transpose(1, 2)
            v = v_cache[first : first + count].view(1, -1, heads, dim)[:, :tokens].transpose(1, 2)
            parts.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qi, k, v, scale=scale)[:2])
        o = parts[0][0] if len(parts) == 1 else merge_by_lse(parts).to(q.dtype)
        out[i] = o.view(-1, dim)
    return out


def chunk_view_plan(meta: AttentionMetadata, page: int) -> dict[int, tuple[list[tuple[int, int, int]], torch.Tensor]]:
    """For each prefill chunk after cached context whose cached blocks form at most
    :data:`MAX_VIEW_RUNS` runs: its request index -> (the runs of its cached context, the cache
    slots of the chunk's own tokens). Other chunks take the gathering reference."""
    plan = {}
    for i in range(meta.num_decodes, meta.num_requests):
        qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
        if slen == qlen:
            continue
        runs = block_runs(meta.block_tables[i, : -(-(slen - qlen) // page)].tolist(), slen - qlen, page)
        if len(runs) <= MAX_VIEW_RUNS:
            start = int(meta.query_start_loc[i])
            plan[i] = (runs, meta.slot_mapping[start : start + qlen].to(torch.long))
    return plan


def chunk_attention_views(
    q: torch.Tensor, kv_cache: LayerKV, runs: list[tuple[int, int, int]], slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """One request's prefill chunk ``q`` [T, Hq, D] after its cached context (a question after
    the cached documents): the context, seen whole by every row (no mask), is read in place
    through strided views of its block runs, with the GQA group and the chunk's rows as one query
    axis of each KV head; the chunk's own T keys, gathered by their ``slots``, are seen causally.
    The parts are merged by their log-sum-exp. On a 2-core CPU, a 30-token question after 5,000
    cached tokens: no gathered copy of the context and one SDPA call a KV head's whole group.
    A plain (not FP8) cache only."""
    k_cache, v_cache = kv_cache.k, kv_cache.v
    heads, dim = k_cache.shape[2:]
    tokens, hq, _ = q.shape
    group = hq // heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    grouped = q.view(tokens, heads, group, dim).permute(1, 2, 0, 3).reshape(1, heads, group * tokens, dim)  # row g*T + t
    parts = []
    for first, count, n in runs:
        k = k_cache[first : first + count].view(1, -1, heads, dim)[:, :n].transpose(1, 2)
        v = v_cache[first : first + count].view(1, -1, heads, dim)[:, :n].transpose(1, 2)
        parts.append(flash(grouped, k, v, scale=scale)[:2])
    k = k_cache.view(-1, heads, dim).index_select(0, slots).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)  # [1, Hq, T, D]
    v = v_cache.view(-1, heads, dim).index_select(0, slots).transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    o, lse = flash(q.transpose(0, 1).unsqueeze(0), k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale)[:2]
    parts.append((o.reshape(1, heads, group * tokens, dim), lse.reshape(1, heads, group * tokens)))
    return merge_by_lse(parts).view(heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, hq, dim).to(q.dtype)


class TorchReferenceAttention(AttentionBackend):
    name = "torch"

    def rope_and_store(self, q, k, v, positions, cos_sin, kv_cache, meta, pdl=False):  # type: ignore[override]
        rot = meta.scratch.get("cos_sin")
        if rot is None:  # gathered once per step, shared by every layer
            rot = signed_cos_sin(*cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1))
            meta.scratch["cos_sin"] = rot
        q, k = rotate_signed(q, *rot), rotate_signed(k, *rot)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return q

    def attend(self, q, kv_cache, meta, scale, pdl=False):  # type: ignore[override]
        # An FP8 cache takes the gathering path, which dequantizes what it gathers: the in-place
        # views would hand SDPA e4m3 values without their scales.
        if q.device.type == "cpu" and not kv_cache.quantized:
            page = kv_cache.k.shape[1]
            if "decode_views" not in meta.scratch:  # planned once per step, shared by every layer
                meta.scratch["decode_views"] = decode_view_plan(meta, page)
            plan = meta.scratch["decode_views"]
            if plan is not None:
                return decode_attention_views(q, kv_cache, plan, scale)
            if "chunk_views" not in meta.scratch:
                meta.scratch["chunk_views"] = chunk_view_plan(meta, page)
        return paged_attention_reference(q, kv_cache, meta, scale)
