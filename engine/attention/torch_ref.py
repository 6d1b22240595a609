"""Pure-torch paged attention: gather each request's KV blocks, then SDPA.

This is the CPU path and the reference GPU kernels are tested against. Decodes (one query each)
run as one batched SDPA over padded contexts; prefill chunks run one SDPA per request with a
causal mask offset by the request's cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, table: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks ``table`` (flat, ``rows`` requests) of a [blocks, page, H, D] cache as
    [rows, tokens, H, D]. ``index_select`` on whole blocks copies contiguous rows, several
    times faster on the CPU than advanced indexing."""
    page, heads, dim = cache.shape[1:]
    flat = cache.view(cache.shape[0], -1).index_select(0, table.to(torch.long))
    return flat.view(rows, -1, heads, dim)


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every query over its request's cached context (KV already written)."""
    k_cache, v_cache = kv_cache
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        max_len = max(meta.seq_lens_host[:nd])
        nblocks = -(-max_len // block_size)
        table = meta.block_tables[:nd, :nblocks].reshape(-1)
        keys = gather_blocks(k_cache, table, nd)[:, :max_len].transpose(1, 2)  # [nd, Hkv, L, D]
        values = gather_blocks(v_cache, table, nd)[:, :max_len].transpose(1, 2)
        lens = meta.seq_lens[:nd].to(torch.long)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys.to(q.dtype), values.to(q.dtype),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )
        out[:nd] = o.squeeze(2)
    start = nd
    for i in range(nd, meta.num_requests):
        qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
        nblocks = -(-slen // block_size)
        table = meta.block_tables[i, :nblocks]
        keys = gather_blocks(k_cache, table, 1)[0, :slen].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        values = gather_blocks(v_cache, table, 1)[0, :slen].transpose(0, 1).unsqueeze(0)
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
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchReferenceAttention(AttentionBackend):
    name = "torch"

    def rope_and_store(self, q, k, v, positions, cos_sin, kv_cache, meta):  # type: ignore[override]
        rot = meta.scratch.get("cos_sin")
        if rot is None:  # gathered once per step, shared by every layer
            rot = cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
            meta.scratch["cos_sin"] = rot
        cos, sin = rot
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return q

    def attend(self, q, kv_cache, meta, scale):  # type: ignore[override]
        return paged_attention_reference(q, kv_cache, meta, scale)
