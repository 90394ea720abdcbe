"""LoRA admission: at most ``max_loras`` adapters among running requests, and only loaded ones.

vLLM V1's rule: a waiting request whose adapter is not among the running requests' adapters waits
(keeping its place) while they already use ``max_loras`` of them; the running set only grows
through this check, so no step ever needs more than ``max_loras`` worker slots. Before that, an
adapter must be in the workers' host memory: the first request that names it asks the workers to
load it (``SchedulerOutput.lora_prefetch``) and waits, as a request waits for its grammar, until a
worker output reports it loaded (or failed: the requests that wanted it finish with the reason).
"""

from __future__ import annotations

from collections.abc import Iterable

from evenflow.protocol import ModelRunnerOutput
from evenflow.protocol.lora import AdapterRef

from evenflow.core.request import Request


class LoRASlots:
    """The scheduler's view of adapters: which the workers hold, which are asked for."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._loaded: set[str] = set()  # identities in the workers' host memory
        self._asked: set[str] = set()  # prefetched, not reported yet
        self._prefetch: list[AdapterRef] = []  # for the next SchedulerOutput
        self._unloaded: list[str] = []
        self.failed: dict[str, str] = {}  # identity -> why it could not load (until reported)

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether ``request`` may start this step (always, for a base-model request)."""
        ref = request.lora
        if ref is None:
            return True
        if ref.identity not in self._loaded:
            if ref.identity not in self._asked:
                self._asked.add(ref.identity)
                self._prefetch.append(ref)
            return False
        active = {r.lora.identity for r in running if r.lora is not None}
        return ref.identity in active or len(active) < self.max_loras

    def observe(self, output: ModelRunnerOutput) -> None:
        """Apply a worker output's load report."""
        for identity in output.lora_loaded:
            self._asked.discard(identity)
            self._loaded.add(identity)
        for identity in output.lora_evicted:  # asked for again by the next request that needs it
            self._loaded.discard(identity)
        for identity, reason in zip(output.lora_failed, output.lora_failed_reasons):
            self._asked.discard(identity)
            self.failed[identity] = reason

    def unload(self, identity: str, in_use: bool) -> None:
        """An adapter the engine no longer serves: workers may drop its slot once no request uses it
        (requests that hold it finish with the weights they started with)."""
        if not in_use:
            self._unloaded.append(identity)

    def take_orders(self) -> tuple[list[AdapterRef], list[str]]:
        """(prefetches, unloads) for the next SchedulerOutput."""
        orders = (self._prefetch, self._unloaded)
        self._prefetch, self._unloaded = [], []
        return orders
