from __future__ import annotations

import pytest
from evenflow.core.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock


def test_free_queue_popleft_append_and_remove_from_the_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4] and queue.num_free_blocks == 5
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2] and queue.num_free_blocks == 4
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not in the queue any more


def test_new_blocks_come_from_the_head_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_tail_in_the_given_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]


def test_shared_block_is_free_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h")
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 0]


def test_cached_free_block_is_revived_by_a_hit_and_leaves_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[1], b"prefix")
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [0, 1, 2]
    hit = pool.get_cached_block(b"prefix")
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [0, 2]
    assert pool.get_cached_block(b"prefix") is hit  # still cached while in use


def test_eviction_drops_the_hash() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"a")
    pool.cache_block(blocks[1], b"b")
    pool.free_blocks(blocks)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[0] and evicted.block_hash is None
    assert pool.get_cached_block(b"a") is None
    assert pool.get_cached_block(b"b") is blocks[1]


def test_equal_content_is_cached_once() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"same")
    pool.cache_block(second, b"same")
    assert pool.get_cached_block(b"same") is first and second.block_hash is None
    pool.cache_block(first, b"other")  # a hashed block keeps its hash
    assert first.block_hash == b"same" and pool.get_cached_block(b"other") is None


def test_reset_prefix_cache_forgets_hashes_of_free_and_used_blocks() -> None:
    pool = BlockPool(2)
    used, freed = pool.get_new_blocks(2)
    pool.cache_block(used, b"u")
    pool.cache_block(freed, b"f")
    pool.free_blocks([freed])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"u") is None and pool.get_cached_block(b"f") is None
    assert used.block_hash is None and freed.block_hash is None and used.ref_cnt == 1


def test_misuse_raises_errors_that_name_the_block_or_the_count() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="^no free block$"):
        queue.popleft()
    with pytest.raises(ValueError, match=r"^KVBlock\(7, ref=0, hashed=False\) is not in the free queue$"):
        queue.remove(KVBlock(7))  # never queued: both links are None
    with pytest.raises(ValueError, match="^num_blocks must be >= 1, got 0$"):
        BlockPool(0)
    with pytest.raises(ValueError, match="^asked for 3 blocks, 2 free$"):
        BlockPool(2).get_new_blocks(3)


def test_a_new_block_is_the_successor_of_the_one_before_when_nothing_there_can_be_hit() -> None:
    """After ``after``, the next id is taken out of the queue's middle when free and unhashed or hashed
    as the new block will be; a block in use or holding other KV is left, and the head serves."""
    pool = BlockPool(8)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(c, b"other")
    pool.cache_block(d, b"mine")
    pool.free_blocks([d, c, b])  # queue: 4 5 6 7 3 2 1
    (x,) = pool.get_new_blocks(1, after=a)
    assert x is b and pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2]  # unhashed: taken
    (y,) = pool.get_new_blocks(1, after=b)
    assert y.block_id == 4 and b"other" in pool.cached_blocks  # c holds other KV: the head
    first, second = pool.get_new_blocks(2, after=c, hashes=[b"mine"])
    assert first is d and d.block_hash is None and b"mine" not in pool.cached_blocks  # the same KV
    assert second.block_id == 5  # e (4) is in use: the head
    (z,) = pool.get_new_blocks(1, after=pool.blocks[7])  # the last id has no successor
    assert z.block_id == 6
