"""The attention-backend interface and the metadata that describes one step's batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_cache import LayerKV


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and where its KV lives.

    Requests are ordered decodes first (query length 1), then prefill chunks. For request i,
    its new tokens are ``q[query_start_loc[i]:query_start_loc[i+1]]`` at absolute positions
    ``seq_lens[i] - query_len .. seq_lens[i] - 1``; its KV blocks are ``block_tables[i]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    query_lens_host: list[int]
    seq_lens_host: list[int]
    num_decodes: int
    max_seq_len: int
    rows_are_tokens: bool = False
    """Decode rows may be successive tokens of one request, in position order (a verifying step
    laid out a row per token, each with its own context length and its request's block table): a
    row attends to the K/V its request's rows before it write in the same step, so a backend that
    fuses the write into the attention must not read those positions from the cache."""
    row_group: int = 1
    """With ``rows_are_tokens``: at most this many successive rows belong to one request (a
    verifying step's 1 + k)."""
    scratch: dict = field(default_factory=dict)  # per-step values a backend derives once, not per layer

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_host)


class AttentionBackend:
    """Puts this step's K/V into the paged cache (after RoPE), then attends each query to its
    request's context. One instance serves every layer."""

    name = "base"

    def rope_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_cache: LayerKV, meta: AttentionMetadata, pdl: bool = False,
    ) -> torch.Tensor:
        """Rotate q and k by their positions (``cos_sin`` table [positions, head_dim]: cos | sin),
        write k and v to ``meta.slot_mapping``; return the rotated q. ``pdl``: the caller's
        kernels use programmatic dependent launch (CUDA backends may too; others ignore it)."""
        raise NotImplementedError

    def attend(
        self, q: torch.Tensor, kv_cache: LayerKV, meta: AttentionMetadata, scale: float, pdl: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D] against the layer's cache (k, v each [blocks, page, Hkv, D], an FP8 cache's
        scales beside them) -> [T, Hq, D]."""
        raise NotImplementedError

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_cache: LayerKV, meta: AttentionMetadata, scale: float, pdl: bool = False,
    ) -> torch.Tensor:
        """:meth:`rope_and_store` then :meth:`attend` - what a layer calls; a backend may fuse
        the two (the Triton backend does for decode steps)."""
        q = self.rope_and_store(q, k, v, positions, cos_sin, kv_cache, meta, pdl)
        return self.attend(q, kv_cache, meta, scale, pdl)
