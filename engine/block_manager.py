"""Paged KV memory: block allocation, reference counts, and the prefix cache's LRU eviction.

Free blocks live in one ordered dict used as an O(1) queue: allocation takes from the front,
freed blocks that hold cached content go to the back (evicted last, LRU), freed blocks without
content go to the front (reused first). A cached block with no references stays findable by
its hash until it is evicted; a hit on it takes it out of the free queue.
Block 0 is the null block: never allocated, used to pad block tables and dummy slots.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.prefix_cache import BlockHash, PrefixCache, extend_block_hashes
from engine.request import Request

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.prefix_cache = PrefixCache()

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached ones that may be evicted)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering the longest prefix of ``req``; the last token is never a hit
        (its logits are needed). Counts the lookup in the token-level stats."""
        if not self.enable_prefix_caching:
            return []
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.extra_keys)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = self.prefix_cache.longest_prefix(req.block_hashes[:max_blocks])
        self.prefix_cache.stats.queries += req.num_tokens
        self.prefix_cache.stats.hits += len(blocks) * self.block_size
        return blocks

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly computed full blocks under their content hashes (only
        blocks whose token ids the host knows: a pending sampled token is not hashed)."""
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size
        if full <= req.num_registered_blocks:
            return
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.extra_keys)
        for i in range(req.num_registered_blocks, full):
            block = req.block_ids[i]
            if self.block_hash[block] is None and self.prefix_cache.insert(req.block_hashes[i], block):
                self.block_hash[block] = req.block_hashes[i]
        req.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget all cached content (blocks in use keep their data, just not findable)."""
        self.prefix_cache.clear()
        self.block_hash = [None] * self.num_blocks

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        need = self.blocks_needed(req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens)
        need -= len(req.block_ids) + len(cached_blocks)
        reclaimed = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        return max(need, 0) + reclaimed <= self.num_free_blocks

    def free_token_capacity(self, req: Request, cached_blocks: list[int] = ()) -> int:
        """How many more tokens ``req`` could take now (its partial last block + free blocks)."""
        held = (len(req.block_ids) + len(cached_blocks)) * self.block_size
        used = req.num_computed_tokens + len(cached_blocks) * self.block_size
        reclaimed = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        return held - used + max(0, self.num_free_blocks - reclaimed) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give ``req`` the cached blocks (taking references) and enough fresh blocks for
        ``num_new_tokens`` more tokens. All or nothing: False leaves everything unchanged."""
        if not cached_blocks and len(req.block_ids) * self.block_size >= req.num_computed_tokens + num_new_tokens:
            return True  # the common decode step: its last block still has room
        if not self.can_allocate(req, num_new_tokens, cached_blocks):
            return False
        for block in cached_blocks:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1
            req.block_ids.append(block)
        if cached_blocks:
            req.num_registered_blocks = len(req.block_ids)
        need = self.blocks_needed(req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens)
        for _ in range(need - len(req.block_ids)):
            block, _ = self.free_queue.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict the least recently used cached content
                self.prefix_cache.evict(old, block)
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            req.block_ids.append(block)
        return True

    def free(self, req: Request) -> None:
        """Drop the request's references; tail blocks are queued for eviction before head blocks."""
        for block in reversed(req.block_ids):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] < 0:
                raise AssertionError(f"block {block} reference count went negative")
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        req.block_ids = []
        req.num_registered_blocks = 0
