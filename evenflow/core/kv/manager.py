"""Per-request block tables on top of the BlockPool, with prefix caching.

The manager answers three questions for the scheduler: how much of a new request's prompt is
already cached (``get_computed_blocks``), whether a request's next chunk fits
(``allocate_slots``: all or nothing), and gives a finished or preempted request's blocks back
(``free``). Full blocks are hashed and cached as soon as every token in them is known and
scheduled; a request's block hashes are kept on the request and extended one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.protocol import KVCacheStats
from evenflow.protocol.block_hash import BlockHash, extend_block_hashes
from evenflow.core.kv.block_pool import BlockPool, KVBlock
from evenflow.core.request import Request, RequestStatus


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: cached blocks covering the first ``num_tokens`` tokens of a request."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Block tables of running requests; prefix lookups; all-or-nothing slot allocation."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up, once per request (not on resumption)
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self) -> KVCacheStats:
        """The KV cache's part of SchedulerStats."""
        return KVCacheStats(usage=self.pool.usage, prefix_cache_queries=self.prefix_cache_queries,
                            prefix_cache_hits=self.prefix_cache_hits)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached full blocks at the start of the request's known tokens.

        Never the whole sequence: the last token is always recomputed, since its logits are needed.
        None for a request that needs every position's logits (prompt_logprobs), as in vLLM V1.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return ComputedBlocks()
        max_blocks = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, max_blocks, self.block_size, request.cache_extra_keys
        )
        blocks: list[KVBlock] = []
        get_cached_block = self.pool.get_cached_block
        for block_hash in request.block_hashes[:max_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None, cache: bool = True
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``computed`` is the prefix hit of a request being admitted (its ``num_computed_tokens``
        is still 0): those blocks are taken first. Returns the newly allocated blocks (possibly
        none), or None, changing nothing, when the pool cannot serve the whole request.
        ``cache``: offer the blocks those tokens fill to prefix hits (a later step reads them after this
        one wrote them); False for a prompt prefilled by layer groups, whose blocks are offered by the
        call of its last group's step.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None or computed is not None:
            return self._allocate_first(request, num_new_tokens, computed or ComputedBlocks(), cache)
        # A running request: usually a decode that still fits in its last block.
        block_size = self.block_size
        num_total_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = (num_total_tokens + block_size - 1) // block_size - len(req_blocks)
        new_blocks: list[KVBlock] = []
        if num_new_blocks > 0:
            if num_new_blocks > self.pool.free_queue.num_free_blocks:
                return None
            new_blocks = self.pool.get_new_blocks(num_new_blocks, req_blocks[-1] if req_blocks else None,
                                                  self._known_hashes(request, len(req_blocks)))
            req_blocks.extend(new_blocks)
        if self.enable_caching and cache:
            # Only tokens that are known (not placeholders, not drafts) may be hashed.
            num_known = request.num_tokens
            num_full_blocks = (num_total_tokens if num_total_tokens < num_known else num_known) // block_size
            if num_full_blocks > self.num_cached_blocks[request.request_id]:
                self._cache_full_blocks(request, num_full_blocks)
        return new_blocks

    def _allocate_first(self, request: Request, num_new_tokens: int, computed: ComputedBlocks, cache: bool = True
                        ) -> list[KVBlock] | None:
        """First allocation of an admitted (new or resumed) request, after its prefix hit."""
        req_id = request.request_id
        if req_id in self.req_to_blocks:
            raise ValueError(f"{req_id} already holds blocks: a prefix hit applies only on admission")
        num_hit_blocks = len(computed.blocks)
        num_total_tokens = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        num_new_blocks = -(-num_total_tokens // self.block_size) - num_hit_blocks
        # Free cached blocks revived by the hit leave the free queue, so they cannot also count
        # as room for the new blocks.
        num_revived = sum(1 for block in computed.blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return None
        # Touch before allocating, so the allocation cannot evict a block of the hit.
        self.pool.touch(computed.blocks)
        last = computed.blocks[-1] if computed.blocks else None
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0), last, self._known_hashes(request, num_hit_blocks))
        self.req_to_blocks[req_id] = computed.blocks + new_blocks
        self.num_cached_blocks[req_id] = num_hit_blocks
        if self.enable_caching:
            if request.status == RequestStatus.WAITING:
                # A prompt counts once, as in vLLM: a request resuming from preemption finds its own
                # blocks again, and counting that would inflate the hit rate exactly under pressure.
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += computed.num_tokens
            if cache:
                self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens) // self.block_size)
        return new_blocks

    def _known_hashes(self, request: Request, first: int) -> list[BlockHash]:
        """The hashes the request's blocks ``first`` on will hold, as far as their tokens are all known
        (none without prefix caching)."""
        if not self.enable_caching or first * self.block_size + self.block_size > request.num_tokens:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.num_tokens // self.block_size,
                            self.block_size, request.cache_extra_keys)
        return request.block_hashes[first:]

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        req_id = request.request_id
        num_cached = self.num_cached_blocks[req_id]
        if num_full_blocks <= num_cached:
            return
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, num_full_blocks, self.block_size, request.cache_extra_keys
        )
        req_blocks = self.req_to_blocks[req_id]
        for index in range(num_cached, num_full_blocks):
            self.pool.cache_block(req_blocks[index], request.block_hashes[index])
        self.num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Give a request's blocks back: last block first, so prefixes outlive suffixes."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights); running requests are unaffected."""
        return self.pool.reset_prefix_cache()
