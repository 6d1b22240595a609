"""Prefix caching: full KV blocks keyed by a hash chain over their token ids.

A block's hash covers its parent's hash, its own token ids and optional extra keys (e.g. a
documents version), so equal hashes mean equal prefixes. The index maps hash -> physical block;
the block manager owns the blocks and evicts unreferenced cached ones in LRU order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """sha256(parent || token ids || extra keys): collision-safe, stable across processes."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> None:
    """Append the hashes of full blocks of ``token_ids`` not hashed yet (incremental).

    Same values as :func:`hash_block`, computed over one byte buffer: a 32k-token prompt is
    2,000 blocks, hashed in about a millisecond instead of several.
    """
    first, last = len(hashes), len(token_ids) // block_size
    if first >= last:
        return
    data = array("q", token_ids[first * block_size : last * block_size]).tobytes()
    width = 8 * block_size
    extra = repr(extra_keys).encode() if extra_keys else b""
    parent = hashes[-1] if hashes else b"\0"
    sha256 = hashlib.sha256
    for i in range(last - first):
        h = sha256(parent)
        h.update(data[i * width : (i + 1) * width])
        if extra:
            h.update(extra)
        parent = h.digest()
        hashes.append(parent)


@dataclass
class PrefixCacheStats:
    """Token-level counters: prompt tokens looked up, and how many were found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Index of cached full blocks by content hash."""

    def __init__(self) -> None:
        self._index: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._index)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Physical blocks of the longest run of ``hashes`` (from the start) that are cached."""
        blocks = []
        for h in hashes:
            block = self._index.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Register a block; False if that content is already cached in another block."""
        if block_hash in self._index:
            return False
        self._index[block_hash] = block_id
        return True

    def evict(self, block_hash: BlockHash, block_id: int) -> None:
        if self._index.get(block_hash) == block_id:
            del self._index[block_hash]

    def clear(self) -> None:
        self._index.clear()
