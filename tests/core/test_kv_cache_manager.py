from __future__ import annotations

import pytest
from evenflow.core.kv.manager import KVCacheManager
from evenflow.core.request import Request
from evenflow.protocol import SamplingParams


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Look up the prefix, allocate the rest of the known tokens, advance; return the hit."""
    computed = kv.get_computed_blocks(request)
    num_new = request.num_tokens - computed.num_tokens if num_new is None else num_new
    assert kv.allocate_slots(request, num_new, computed) is not None
    request.num_computed_tokens = computed.num_tokens + num_new
    return computed.num_tokens


def test_prefix_hit_is_the_longest_run_of_cached_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(10)))  # blocks [0-3] [4-7] and a partial one
    admit(kv, first)
    same_two_blocks = make_request("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_blocks(same_two_blocks).num_tokens == 8
    diverges_in_block_two = make_request("c", list(range(6)) + [99] * 5)
    assert kv.get_computed_blocks(diverges_in_block_two).num_tokens == 4
    diverges_in_block_one = make_request("d", [99] + list(range(1, 11)))
    assert kv.get_computed_blocks(diverges_in_block_one).num_tokens == 0


def test_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request("a", list(range(12))))
    again = make_request("b", list(range(12)))
    computed = kv.get_computed_blocks(again)
    assert computed.num_tokens == 8  # not 12: the last block holds the last token
    assert admit(kv, make_request("c", list(range(13)))) == 12


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    big = make_request("big", list(range(20)))  # needs 5 blocks
    computed = kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, 20, computed) is None
    assert kv.num_free_blocks == 4 and "big" not in kv.req_to_blocks
    small = make_request("small", list(range(6)))
    new_blocks = kv.allocate_slots(small, 6, kv.get_computed_blocks(small))
    assert new_blocks is not None and len(new_blocks) == 2
    small.num_computed_tokens = 6
    assert kv.allocate_slots(small, 11) is None  # 17 tokens need 5 blocks
    assert len(kv.get_blocks("small")) == 2 and kv.num_free_blocks == 2
    assert kv.allocate_slots(small, 2) == []  # 8 tokens fit in the 2 blocks it has
    assert len(kv.allocate_slots(small, 10) or []) == 2


def test_revived_hit_blocks_do_not_count_as_room() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(9)))
    admit(kv, first)  # 3 blocks, two of them full and cached
    kv.free(first)
    assert kv.num_free_blocks == 4
    # Hit on 2 free cached blocks; 4 more blocks would be needed but only 2 others are free.
    longer = make_request("b", list(range(8)) + [7] * 16)
    computed = kv.get_computed_blocks(longer)
    assert computed.num_tokens == 8
    assert kv.allocate_slots(longer, 16, computed) is None
    assert kv.num_free_blocks == 4 and all(block.ref_cnt == 0 for block in computed.blocks)
    assert kv.get_computed_blocks(longer).num_tokens == 8  # nothing was evicted by the attempt


def test_hit_blocks_are_shared_and_not_evicted_by_the_same_allocation() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(8)) + [1])
    admit(kv, first)  # blocks 0, 1 (cached), 2
    kv.free(first)
    filler = make_request("filler", [50] * 8)
    admit(kv, filler)  # takes 3 and 2
    kv.free(filler)
    assert kv.pool.free_queue.block_ids()[:2] == [1, 0]  # the cached prefix is next to evict
    second = make_request("b", list(range(8)) + [2, 3, 4, 5, 6, 7])
    assert admit(kv, second) == 8
    assert [block.block_id for block in kv.get_blocks("b")] == [0, 1, 2, 3]
    kv.free(second)
    third = make_request("c", list(range(8)) + [9])
    fourth = make_request("d", list(range(8)) + [9, 9])
    assert admit(kv, third) == 8 and admit(kv, fourth) == 8
    assert [block.ref_cnt for block in kv.get_blocks("c")[:2]] == [2, 2]


def test_free_returns_blocks_last_first_so_prefixes_outlive_suffixes() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(12)) + [0])
    admit(kv, request)
    ids = [block.block_id for block in kv.get_blocks("a")]
    kv.free(request)
    assert kv.pool.free_queue.block_ids() == list(reversed(ids))


def test_blocks_are_cached_as_decode_fills_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, request)
    assert len(kv.pool.cached_blocks) == 1
    request.append_output_token_ids(7)
    assert kv.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    request.append_output_token_ids(8)
    assert len(kv.pool.cached_blocks) == 1  # position 7 (token 8) is not scheduled yet
    kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    assert len(kv.pool.cached_blocks) == 2
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])).num_tokens == 8


def test_blocks_ending_in_unknown_tokens_are_not_cached() -> None:
    # Overlap: position 7 is scheduled before the token that fills it is known.
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    admit(kv, request)  # computes positions 0..6; the step samples position 7
    assert kv.allocate_slots(request, 1) == []  # position 7, token still in flight
    request.num_computed_tokens += 1
    assert len(kv.pool.cached_blocks) == 1 and len(request.block_hashes) == 1
    request.append_output_token_ids(8)  # now known
    kv.allocate_slots(request, 1)
    assert len(kv.pool.cached_blocks) == 2


def test_usage_counters_and_reset() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.usage == 0.0
    admit(kv, make_request("a", list(range(9))))
    assert kv.usage == pytest.approx(0.3)
    admit(kv, make_request("b", list(range(9))))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)
    lookup_only = make_request("c", list(range(9)))
    kv.get_computed_blocks(lookup_only)
    assert kv.prefix_cache_queries == 18  # counted when admitted, not per lookup
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(lookup_only).num_tokens == 0


def test_prefix_caching_can_be_disabled() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    admit(kv, make_request("a", list(range(9))))
    assert admit(kv, make_request("b", list(range(9)))) == 0
    assert not kv.pool.cached_blocks and (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_freeing_a_request_leaves_nothing_of_it_behind() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(9)))
    admit(kv, request)
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.free(request)
    # A long-running engine sees millions of ids: no per-request entry may outlive its request.
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    assert kv.get_blocks("a") == [] and kv.get_block_ids("a") == []
    assert kv.num_free_blocks == 8


@pytest.mark.parametrize("length", [4, 5])  # hashed when allocated (4) or already when looked up (5)
def test_cache_extra_keys_keep_requests_from_sharing_blocks(length: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    salted = make_request("salted", list(range(length)))
    salted.cache_extra_keys = ("adapter-a",)
    admit(kv, salted)
    plain = make_request("plain", list(range(5)))
    assert kv.get_computed_blocks(plain).num_tokens == 0
    same_salt = make_request("same-salt", list(range(5)))
    same_salt.cache_extra_keys = ("adapter-a",)
    assert kv.get_computed_blocks(same_salt).num_tokens == 4


def test_blocks_in_use_at_a_reset_are_never_cached_again() -> None:
    """After reset_prefix_cache (new weights) a running request's old blocks stay private."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    running = make_request("running", list(range(8)))
    admit(kv, running)
    assert kv.reset_prefix_cache()
    running.append_output_token_ids([8, 9, 10, 11])
    assert kv.allocate_slots(running, 4) is not None  # fills and caches its third block
    running.num_computed_tokens = 12
    assert kv.get_computed_blocks(make_request("later", list(range(13)))).num_tokens == 0


def test_a_prefix_hit_applies_only_on_admission() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(6)))
    admit(kv, request)
    with pytest.raises(ValueError, match="^a already holds blocks: a prefix hit applies only on admission$"):
        kv.allocate_slots(request, 1, kv.get_computed_blocks(request))


def test_prefix_cache_counters_add_up_over_admissions() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for request_id in "abc":
        admit(kv, make_request(request_id, list(range(9))))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (27, 16)  # hits of 0, 8 and 8 tokens


def test_a_next_turn_continues_its_first_turns_range_of_blocks() -> None:
    """A multi-turn chat's next prompt (the first turn's tokens and more) hits the first turn's full
    blocks and continues after them in the same range of ids (the freed partial block), and a prompt
    sent again takes its own last block back (the same KV), so the attention reads either in place."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    other = make_request("other", [90, 91, 92, 93])
    admit(kv, other)  # block 0, so the free queue does not start at the first turn's ids
    turn1 = make_request("t1", list(range(10)))
    admit(kv, turn1)
    assert kv.get_block_ids("t1") == [1, 2, 3]
    kv.free(turn1)  # queue: 4 .. 15, then 3 2 1
    turn2 = make_request("t2", list(range(10)) + [40, 41, 42, 43])
    assert admit(kv, turn2) == 8
    assert kv.get_block_ids("t2") == [1, 2, 3, 4]
    kv.free(turn2)
    again = make_request("again", list(range(10)) + [40, 41, 42, 43])
    assert admit(kv, again) == 12
    assert kv.get_block_ids("again") == [1, 2, 3, 4]
    kv.free(again)
    repeat = make_request("repeat", list(range(8)))  # a full last block: recomputed, and taken back
    assert admit(kv, repeat) == 4
    assert kv.get_block_ids("repeat") == [1, 2]
    assert kv.get_computed_blocks(make_request("later", list(range(8)) + [7])).num_tokens == 8  # cached again
