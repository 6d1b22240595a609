"""Paged KV blocks and the prefix cache, without a model."""

from __future__ import annotations

from engine.block_manager import NULL_BLOCK, BlockManager
from engine.prefix_cache import hash_block
from tests.engine.helpers import make_request


def test_allocation_is_all_or_nothing_and_never_hands_out_the_null_block():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = make_request("a", 10)
    assert bm.allocate_slots(a, 10)  # 3 blocks
    assert NULL_BLOCK not in a.block_ids and len(a.block_ids) == 3
    b = make_request("b", 9)
    assert not bm.allocate_slots(b, 9)  # needs 3, only 1 free
    assert b.block_ids == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == bm.num_usable_blocks == 4


def test_growing_a_request_allocates_only_new_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = make_request("r", 4)
    assert bm.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    assert bm.allocate_slots(r, 1) and len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert bm.allocate_slots(r, 3) and len(r.block_ids) == 2  # still fits in block 2


def test_prefix_hits_share_blocks_and_count_tokens():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_request("a", 10)
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # two full blocks registered
    b = make_request("b", 10)
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_ids[:2]
    assert bm.prefix_cache.stats.queries == 10 and bm.prefix_cache.stats.hits == 8
    assert bm.allocate_slots(b, 2, hit)
    assert [bm.ref_cnt[x] for x in hit] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert all(c == 0 for c in bm.ref_cnt)


def test_last_prompt_token_is_never_a_hit():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_request("a", 8)
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = make_request("b", 8)  # identical 8 tokens = exactly two blocks
    assert len(bm.find_cached_prefix(b)) == 1  # the block holding the last token is recomputed


def test_unreferenced_cached_blocks_survive_until_evicted_in_lru_order():
    bm = BlockManager(num_blocks=7, block_size=2)  # 6 usable
    a = make_request("a", 4, start_token=1)
    assert bm.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.num_free_blocks == 6 and len(bm.prefix_cache) == 2
    # a fresh request uses never-cached blocks first
    b = make_request("b", 8, start_token=100)
    assert bm.allocate_slots(b, 8)
    assert len(bm.prefix_cache) == 2
    assert bm.find_cached_prefix(make_request("a2", 5, start_token=1))  # still a hit
    bm.free(b)
    # filling the whole pool evicts a's blocks, tail block first
    c = make_request("c", 11, start_token=500)
    assert bm.allocate_slots(c, 11)
    assert len(bm.prefix_cache) == 0


def test_hit_on_a_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(num_blocks=5, block_size=2)
    a = make_request("a", 5)
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_request("b", 5)
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2
    assert bm.allocate_slots(b, 1, hit)
    assert all(x not in bm.free_queue for x in hit)
    assert bm.num_free_blocks == 4 - 3


def test_hash_chain_depends_on_the_whole_prefix_and_extra_keys():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 2]), [3, 4])
    assert hash_block(None, [1, 2], ("docs-v1",)) != hash_block(None, [1, 2], ("docs-v2",))
    assert hash_block(None, [1, 2]) == h1  # stable


def test_reset_prefix_cache_forgets_content():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = make_request("a", 6)
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_request("b", 6)) == []


def test_incremental_block_hashes_equal_the_hash_chain():
    from engine.prefix_cache import extend_block_hashes

    tokens = list(range(1000, 1037))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:9], 4, ("v1",))  # two blocks now, more later
    extend_block_hashes(hashes, tokens, 4, ("v1",))
    expected, parent = [], None
    for i in range(len(tokens) // 4):
        parent = hash_block(parent, tokens[4 * i : 4 * i + 4], ("v1",))
        expected.append(parent)
    assert hashes == expected
