"""Adapters in host memory: an LRU of ``max_cpu_loras``, filled by a loader thread off the step path.

The engine-core asks for an adapter ahead of its first step (``SchedulerOutput.lora_prefetch``);
the thread reads and shards it while steps run; each step's output reports what finished loading,
what failed and what was evicted, so the scheduler admits a request only once its adapter is here
(as it does once a grammar compiled). ``get`` still loads synchronously on a miss, so a rank that is
behind, or an adapter evicted between its report and its first step, only costs time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from evenflow.protocol.lora import AdapterRef
from evenflow.worker.lora.weights import HostAdapter

log = logging.getLogger("evenflow.worker.lora")


class HostAdapterCache:
    """identity -> HostAdapter, least recently used first."""

    def __init__(self, capacity: int, load: Callable[[AdapterRef], HostAdapter]) -> None:
        self.capacity = max(capacity, 1)
        self._load = load
        self._cache: OrderedDict[str, HostAdapter] = OrderedDict()
        self._pending: dict[str, Future[HostAdapter]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.loaded: list[str] = []  # since the last report
        self.failed: list[tuple[str, str]] = []  # (identity, reason)
        self.evicted: list[str] = []

    def prefetch(self, ref: AdapterRef) -> None:
        if ref.identity not in self._cache and ref.identity not in self._pending:
            self._pending[ref.identity] = self._executor.submit(self._load, ref)

    def collect(self, wait: bool = False) -> None:
        """Move finished loads into the cache (all pending ones with ``wait``)."""
        for identity, future in list(self._pending.items()):
            if not (wait or future.done()):
                continue
            del self._pending[identity]
            try:
                self._insert(future.result())
            except Exception as e:  # a bad folder: the scheduler fails the requests that wanted it
                log.warning("LoRA adapter %s failed to load: %s", identity, e)
                self.failed.append((identity, f"{type(e).__name__}: {e}"))
                continue
            self.loaded.append(identity)

    def get(self, ref: AdapterRef) -> HostAdapter:
        """The adapter's tensors, loading them now if they are not here (the slow path)."""
        self.collect()
        future = self._pending.get(ref.identity)
        if future is not None:  # a rank behind rank 0: wait for this load only
            future.exception()
            self.collect()
        adapter = self._cache.get(ref.identity)
        if adapter is None:
            adapter = self._load(ref)
            self._insert(adapter)
        self._cache.move_to_end(ref.identity)
        return adapter

    def _insert(self, adapter: HostAdapter) -> None:
        self._cache[adapter.ref.identity] = adapter
        self._cache.move_to_end(adapter.ref.identity)
        while len(self._cache) > self.capacity:
            identity, _ = self._cache.popitem(last=False)
            self.evicted.append(identity)

    def take_report(self) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        """(loaded, failed, evicted) since the previous report."""
        report = (self.loaded, self.failed, self.evicted)
        self.loaded, self.failed, self.evicted = [], [], []
        return report

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
