"""Prefix-cache changes recorded by the BlockPool and reported to frontends in batches.

Frontends that route among several engine-cores keep an index of which block hashes each engine
holds; these reports keep that index true to what the engine stored and evicted. Each hash keeps
only its latest state within a batch (stored then evicted in one batch reports "removed"), so the
order of a batch's two lists does not matter.
"""

from __future__ import annotations

import time

from evenflow.protocol import KVCacheEvents
from evenflow.protocol.block_hash import BlockHash

REPORT_INTERVAL_S = 0.05  # while busy, batch changes over steps; an idle engine reports at once


class KVEventLog:
    """Changes since the last ``drain``: hash -> True (stored) / False (removed)."""

    def __init__(self) -> None:
        self._changes: dict[BlockHash, bool] = {}
        self._cleared = False
        self._last_drain = 0.0

    def stored(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = False

    def cleared(self) -> None:
        self._changes.clear()
        self._cleared = True

    def drain(self, force: bool = False) -> KVCacheEvents | None:
        """The batch to report now (None: nothing, or too soon after the last one unless ``force``)."""
        if not self._changes and not self._cleared:
            return None
        now = time.monotonic()
        if not force and now - self._last_drain < REPORT_INTERVAL_S:
            return None
        changes = self._changes
        events = KVCacheEvents([h for h, kept in changes.items() if kept],
                               [h for h, kept in changes.items() if not kept], self._cleared)
        self._changes, self._cleared, self._last_drain = {}, False, now
        return events
