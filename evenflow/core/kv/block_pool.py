"""Every physical KV block: ref counts, the free LRU queue, and the hash -> block map.

A block is free when its ref count is 0; free blocks sit in a doubly linked LRU queue (evicted
from the head, returned to the tail). A free block that is full and hashed still holds valid KV:
a prefix-cache hit revives it, taking it out of the middle of the queue in O(1). When a free block
is handed out again (evicted), its hash is dropped from the map.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from evenflow.protocol.block_hash import BlockHash
from evenflow.core.kv.events import KVEventLog


class KVBlock:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue while free."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) popleft, append, remove."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next evicted) to tail; for tests and debugging."""
        ids: list[int] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every block; hands out, takes back, caches and looks up blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        # Set by the engine-core to report stored/evicted hashes to prefix-aware routers.
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int, after: KVBlock | None = None,
                       hashes: Sequence[BlockHash] = ()) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks (evicting their hashes), ref 1 each: from the head of the free
        queue, or, with ``after`` (the request's last block), each one the id after the block before it
        where that block is free and holds nothing another request could hit (no hash, or ``hashes[i]``,
        the hash the new block will hold: the same KV). A lone stream's context then stays one range of
        ids, which the CPU attention reads in place (a multi-turn chat's next turn, a prompt sent again)."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.free_queue.num_free_blocks} free")
        blocks = []
        for i in range(num_blocks):
            block = None
            if after is not None and after.block_id + 1 < self.num_blocks:
                successor = self.blocks[after.block_id + 1]
                if successor.ref_cnt == 0 and (successor.block_hash is None
                                               or (i < len(hashes) and successor.block_hash == hashes[i])):
                    self.free_queue.remove(successor)
                    block = successor
            if block is None:
                block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
            after = block
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash, unless it or an equal block is cached already."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return  # an equal block is already shared; this one stays private and uncached
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Blocks in use keep their KV and owners; they just stop being shared."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()
        return True
