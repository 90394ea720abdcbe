"""Choosing an engine-core for each request: prefix affinity, load, and a hot-spot guard.

Load is vLLM's data-parallel score, ``4 * waiting + running``, from the SchedulerStats every
engine-core sends with its outputs, plus the requests this frontend routed there since those
stats (counted as waiting), so a burst does not pile onto one engine between two reports.

Policies (``--routing-policy``):

* ``prefix`` (default): as SGLang's cache-aware router. When the load gap between the busiest and
  the idlest engine is large both in absolute terms (``> balance_abs_threshold``) and in relative
  terms (``busiest > balance_rel_threshold * idlest``), route by load: the cache does not pay for
  a queue. Otherwise route to the engine whose PrefixIndex holds the longest prefix of the
  prompt's block hashes (ties and no match at all: the least loaded).
  The absolute default (8: two waiting requests) is lower than SGLang's 32 because CPU-sized
  engines run a few requests each: at 32 a prefix shared by every request (one system prompt)
  sent all of them to one engine-core; the relative test keeps large engines from balancing on
  small differences.
* ``load``: always the least loaded.
* ``round_robin``: in turn, ignoring both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.protocol import KVCacheEvents, SchedulerStats

from evenflow.frontend.clients.prefix_index import BlockHash, PrefixIndex

ROUTING_POLICIES = ("prefix", "load", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    """The frontend's ``--routing-*`` flags."""

    policy: str = "prefix"
    balance_abs_threshold: float = 8.0  # in load-score units (4 per waiting request, 1 per running)
    balance_rel_threshold: float = 1.5

    def validate(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"--routing-policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("--routing-balance-abs-threshold must be >= 0 and --routing-balance-rel-threshold >= 1")


@dataclass
class EngineView:
    """What the router knows about one engine-core."""

    index: PrefixIndex
    num_waiting: int = 0
    num_running: int = 0
    routed_since_stats: int = 0  # requests sent there after its latest stats

    @property
    def load(self) -> int:
        return 4 * (self.num_waiting + self.routed_since_stats) + self.num_running


@dataclass
class Decision:
    engine: int
    matched_blocks: int
    reason: str  # "prefix", "load", "balance" (the hot-spot guard) or "round_robin"


@dataclass
class Router:
    """Per-engine views and the policy; plain state, driven by the data-parallel client."""

    config: RoutingConfig
    engines: list[EngineView] = field(default_factory=list)
    _turn: int = 0

    @classmethod
    def for_engines(cls, config: RoutingConfig, capacities: list[int]) -> "Router":
        return cls(config, [EngineView(PrefixIndex(c)) for c in capacities])

    def choose(self, block_hashes: list[BlockHash], candidates: list[int]) -> Decision:
        """Pick one of ``candidates`` (indexes of reachable engines; not empty)."""
        policy = self.config.policy
        self._turn += 1
        if policy == "round_robin":
            return Decision(candidates[self._turn % len(candidates)], 0, "round_robin")
        views = self.engines
        idlest = self._least_loaded(candidates)
        if policy == "load" or not block_hashes:
            return Decision(idlest, views[idlest].index.match(block_hashes), "load")
        low, high = views[idlest].load, max(views[e].load for e in candidates)
        if high - low > self.config.balance_abs_threshold and high > self.config.balance_rel_threshold * low:
            return Decision(idlest, views[idlest].index.match(block_hashes), "balance")
        matches = {e: views[e].index.match(block_hashes) for e in candidates}
        best = max(matches.values())
        chosen = self._least_loaded([e for e in candidates if matches[e] == best])
        return Decision(chosen, best, "prefix" if best else "load")

    def _least_loaded(self, candidates: list[int]) -> int:
        """Ties go round the engines in turn, so an idle cluster still spreads its requests."""
        n = len(self.engines)
        return min(candidates, key=lambda e: (self.engines[e].load, (e - self._turn) % n))

    def on_routed(self, engine: int, block_hashes: list[BlockHash]) -> None:
        view = self.engines[engine]
        view.routed_since_stats += 1
        if self.config.policy == "prefix":
            view.index.add(block_hashes)

    def on_stats(self, engine: int, stats: SchedulerStats) -> None:
        view = self.engines[engine]
        view.num_waiting, view.num_running = stats.scheduler.num_waiting, stats.scheduler.num_running
        view.routed_since_stats = 0

    def on_kv_events(self, engine: int, events: KVCacheEvents) -> None:
        self.engines[engine].index.apply(events)

    def on_engine_restart(self, engine: int) -> None:
        """A restarted engine-core starts with an empty cache and queue."""
        view = self.engines[engine]
        view.index.clear()
        view.num_waiting = view.num_running = view.routed_since_stats = 0
