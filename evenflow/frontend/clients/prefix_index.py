"""Which KV blocks one engine-core most likely holds, keyed by block hash (evenflow/protocol/block_hash.py).

Fed two ways: the hashes of every prompt this frontend routed there (known at once, before the
engine has computed anything, so back-to-back requests sharing a new prefix meet on one engine),
and the engine's own reports of blocks stored and evicted (``KVCacheEvents``; they cover the other
frontends' requests and remove what the engine evicted). Bounded by the engine's number of KV
blocks: it cannot hold more, and the least recently seen hashes go first, as in its free queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from evenflow.protocol import KVCacheEvents

BlockHash = bytes


class PrefixIndex:
    """An LRU set of block hashes, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hashes

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt are (most likely) cached here."""
        hashes = self._hashes
        for i, h in enumerate(block_hashes):
            if h not in hashes:
                return i
        return len(block_hashes)

    def add(self, block_hashes: Sequence[BlockHash]) -> None:
        hashes = self._hashes
        for h in block_hashes:
            hashes[h] = None
            hashes.move_to_end(h)
        while len(hashes) > self.capacity:
            hashes.popitem(last=False)

    def apply(self, events: KVCacheEvents) -> None:
        """Follow the engine's report: a reset first, then what it stored and evicted."""
        if events.cleared:
            self._hashes.clear()
        self.add(events.stored)
        for h in events.removed:
            self._hashes.pop(h, None)

    def clear(self) -> None:
        self._hashes.clear()
