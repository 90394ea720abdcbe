"""The block pool reports what it caches and evicts, batched, each hash in its latest state."""

from __future__ import annotations

from evenflow.core.kv.block_pool import BlockPool
from evenflow.core.kv.events import KVEventLog
from evenflow.protocol import KVCacheEvents, Outputs
from evenflow.protocol.codec import Codec


def test_pool_reports_stored_evicted_and_cleared() -> None:
    pool = BlockPool(2)
    pool.events = log = KVEventLog()
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"A" * 16)
    pool.cache_block(b, b"B" * 16)
    pool.free_blocks([a, b])
    assert log.drain(force=True) == KVCacheEvents([b"A" * 16, b"B" * 16], [])
    assert log.drain(force=True) is None
    (c,) = pool.get_new_blocks(1)  # evicts A (the LRU head)
    pool.cache_block(c, b"C" * 16)
    assert log.drain() is None  # too soon after the last batch, unless forced
    assert log.drain(force=True) == KVCacheEvents([b"C" * 16], [b"A" * 16])
    pool.cache_block(c, b"C" * 16)  # already cached: no event
    pool.reset_prefix_cache()
    assert log.drain(force=True) == KVCacheEvents([], [], cleared=True)


def test_events_travel_in_outputs_and_old_messages_still_decode() -> None:
    codec: Codec[Outputs] = Codec(Outputs)
    msg = Outputs([], None, 1.0, KVCacheEvents([b"x" * 16], [b"y" * 16]))
    assert codec.decode(codec.encode(msg)) == msg
    assert codec.decode(codec.encode(Outputs([], None, 2.0))).kv_events is None
