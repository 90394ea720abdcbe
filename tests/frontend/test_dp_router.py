"""The data-parallel router: prefix index, policies, the hot-spot guard, stats totals, metrics labels."""

from __future__ import annotations

from evenflow.frontend.clients.data_parallel import sum_stats
from evenflow.frontend.clients.router import Router, RoutingConfig
from evenflow.frontend.metrics import FrontendMetrics
from evenflow.frontend.clients.prefix_index import PrefixIndex
from evenflow.protocol import KVCacheEvents, KVCacheStats, SchedulerCounts, SchedulerStats, TokenBudgetStats
from evenflow.protocol.block_hash import extend_block_hashes


def _stats(**counts: int) -> SchedulerStats:
    return SchedulerStats(scheduler=SchedulerCounts(**counts))


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, (len(tokens) - 1) // block_size, block_size)
    return out


def test_prefix_index_follows_events_and_stays_bounded() -> None:
    a, b = hashes(list(range(17))), hashes(list(range(100, 117)))
    index = PrefixIndex(capacity=6)
    index.apply(KVCacheEvents(stored=a))
    assert index.match(a) == 4 and index.match(b) == 0
    index.apply(KVCacheEvents(removed=[a[2]]))
    assert index.match(a) == 2  # a chain: blocks after a missing one do not count
    index.add(b)  # capacity 6: the least recently seen of a's go first
    assert len(index) == 6 and index.match(b) == 4 and a[0] not in index
    index.apply(KVCacheEvents(stored=[a[0]], cleared=True))
    assert len(index) == 1 and a[0] in index


def test_prefix_policy_follows_the_cache_and_spreads_new_prefixes() -> None:
    router = Router.for_engines(RoutingConfig("prefix"), [100, 100])
    first = hashes(list(range(33)))
    d = router.choose(first, [0, 1])
    router.on_routed(d.engine, first)
    other = hashes(list(range(500, 533)))
    d2 = router.choose(other, [0, 1])
    assert d2.engine != d.engine and d2.reason == "load"  # no match: least loaded (it counts routed ones)
    follow_up = hashes(list(range(33)) + [7] * 16)  # the same conversation, one turn later
    d3 = router.choose(follow_up, [0, 1])
    assert (d3.engine, d3.matched_blocks, d3.reason) == (d.engine, 8, "prefix")


def test_hot_spot_guard_needs_both_gaps() -> None:
    cfg = RoutingConfig("prefix", balance_abs_threshold=32, balance_rel_threshold=1.5)
    router = Router.for_engines(cfg, [100, 100])
    prompt = hashes(list(range(33)))
    router.on_kv_events(0, KVCacheEvents(stored=prompt))
    router.on_stats(0, _stats(num_running=8, num_waiting=10))  # load 48
    router.on_stats(1, _stats(num_running=8, num_waiting=0))  # load 8: gap 40 > 32 and 48 > 1.5*8
    assert router.choose(prompt, [0, 1]).reason == "balance"
    assert router.choose(prompt, [0, 1]).engine == 1
    router.on_stats(1, _stats(num_running=30, num_waiting=0))  # gap 18: small in absolute terms
    assert router.choose(prompt, [0, 1]).engine == 0
    router.on_stats(0, _stats(num_running=200, num_waiting=10))  # gap 210 but 240 < 1.5*170
    router.on_stats(1, _stats(num_running=150, num_waiting=5))
    assert router.choose(prompt, [0, 1]).engine == 0
    assert router.choose(prompt, [1]).engine == 1  # only reachable engines are candidates


def test_load_and_round_robin_policies() -> None:
    load = Router.for_engines(RoutingConfig("load"), [10, 10, 10])
    load.on_stats(0, _stats(num_running=1))
    load.on_stats(2, _stats(num_running=2))
    picks = []
    for _ in range(3):
        d = load.choose([], [0, 1, 2])
        load.on_routed(d.engine, [])
        picks.append(d.engine)
    assert picks == [1, 0, 2]  # each routed request counts as waiting (4) until the next stats
    rr = Router.for_engines(RoutingConfig("round_robin"), [10, 10])
    assert [rr.choose([], [0, 1]).engine for _ in range(4)] in ([1, 0, 1, 0], [0, 1, 0, 1])


def test_restart_forgets_the_engine() -> None:
    router = Router.for_engines(RoutingConfig(), [10, 10])
    prompt = hashes(list(range(9)))
    router.on_routed(1, prompt)
    router.on_engine_restart(1)
    assert router.engines[1].index.match(prompt) == 0 and router.engines[1].load == 0


def test_sum_stats_adds_counts_and_averages_usage() -> None:
    total = sum_stats([
        SchedulerStats(scheduler=SchedulerCounts(num_running=2), kv_cache=KVCacheStats(usage=0.5, prefix_cache_hits=10)),
        SchedulerStats(scheduler=SchedulerCounts(num_running=3), kv_cache=KVCacheStats(usage=0.1, prefix_cache_hits=5)),
    ])
    assert (total.scheduler.num_running, total.kv_cache.prefix_cache_hits) == (5, 15)
    assert abs(total.kv_cache.usage - 0.3) < 1e-9


def test_sum_stats_adds_the_adaptive_budget_histograms_bucket_by_bucket() -> None:
    total = sum_stats([SchedulerStats(budget=TokenBudgetStats(target_itl_s=0.05, token_budget_log2_counts=[0, 2, 1])),
                       SchedulerStats(budget=TokenBudgetStats(target_itl_s=0.05, token_budget_log2_counts=[1, 1]))])
    assert total.budget.token_budget_log2_counts == [1, 3, 1] and total.budget.target_itl_s == 0.05


def test_metrics_label_each_engine_and_keep_the_total() -> None:
    m = FrontendMetrics("demo")
    per = {"0": _stats(num_running=2), "1": _stats(num_running=3)}
    m.set_engine_stats(sum_stats(list(per.values())), per_engine=per)
    text = m.render()
    from prometheus_client.parser import text_string_to_metric_families

    families = [f for f in text_string_to_metric_families(text) if f.name == "evenflow:num_requests_running"]
    assert len(families) == 1  # one family: the total and each engine-core's line
    values = {s.labels.get("engine", "total"): s.value for s in families[0].samples}
    assert values == {"total": 5, "0": 2, "1": 3}
    assert all(s.labels["model_name"] == "demo" for s in families[0].samples)


# ----------------------------------------------------------------------------- the client, over fakes

import asyncio
from typing import AsyncIterator

import pytest

from evenflow.frontend.clients.engine_client import EngineError
from evenflow.frontend.clients.data_parallel import DataParallelClient
from evenflow.protocol import Outputs, Ready, RequestOutput, SamplingParams, UtilityResult


class FakeEngine:
    def __init__(self, name: str, block_size: int = 4) -> None:
        self.ready = Ready(1, "m", "/m", 64, 100, [2], block_size, 50, 64, name)
        self.connected, self.failure = True, None
        self.aborted: list[str] = []
        self.seen: list[str] = []
        self.on_outputs = None

    async def connect(self, timeout: float) -> Ready:
        return self.ready

    async def generate(self, rid: str, prompt: list[int], sp: SamplingParams, priority: int = 0,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        self.seen.append(rid)
        yield RequestOutput(rid, [1])
        yield RequestOutput(rid, [2], finish_reason="length")

    async def abort(self, ids: list[str]) -> None:
        self.aborted += ids

    async def call_utility(self, method: str, timeout: float = 30.0) -> UtilityResult:
        return UtilityResult(0, True, _stats(num_running=1, num_generation_tokens=5))

    async def close(self) -> None:
        self.connected = False


def _client(*engines: FakeEngine) -> DataParallelClient:
    client = DataParallelClient([f"ipc://{e.ready.engine_id}" for e in engines], "t")
    client.clients = list(engines)  # type: ignore[assignment]
    return client


def test_client_routes_aborts_and_aggregates_over_fakes() -> None:
    async def main() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        client = _client(a, b)
        await client.connect()
        prompt = list(range(3, 20))
        assert [o.new_token_ids async for o in client.generate("r1", prompt, SamplingParams())] == [[1], [2]]
        first = a if a.seen else b
        first.on_outputs(Outputs([], SchedulerStats(), 0.0, KVCacheEvents(stored=hashes(prompt))))  # type: ignore[misc]
        [o async for o in client.generate("r2", prompt, SamplingParams())]
        assert first.seen == ["r1", "r2"]  # the second follows the cached prefix
        stream = client.generate("r3", [50, 51], SamplingParams())
        await stream.__anext__()
        with pytest.raises(EngineError, match="already live"):
            await client.generate("r3", [1], SamplingParams()).__anext__()
        await client.abort(["r3", "unknown"])
        owner = a if "r3" in a.seen else b
        assert owner.aborted == ["r3"] and (b if owner is a else a).aborted == []
        await stream.aclose()
        stats = await client.call_utility("get_stats")
        assert stats.result.scheduler.num_running == 2 and set(client.engine_stats()) == {"0", "1"}
        a.connected = False  # only b is reachable: everything goes there
        [o async for o in client.generate("r4", prompt, SamplingParams())]
        assert b.seen[-1] == "r4"
        b.connected = False
        with pytest.raises(EngineError, match="no engine-core is reachable"):
            await client.generate("r5", prompt, SamplingParams()).__anext__()
        a.ready = Ready(1, "m", "/m", 64, 100, [2], 4, 50, 64, "a-restarted")
        a.connected = True
        client.router.engines[0].index.add(hashes(prompt))  # type: ignore[union-attr]
        [o async for o in client.generate("r6", [60] * 9, SamplingParams())]
        assert a.seen[-1] == "r6"  # it rejoined ...
        assert client.router.engines[0].index.match(hashes(prompt)) == 0  # type: ignore[union-attr]  # ... empty
        await client.close()

    asyncio.run(main())


def test_client_refuses_engines_serving_different_models() -> None:
    async def main() -> None:
        with pytest.raises(EngineError, match="disagree on block_size"):
            await _client(FakeEngine("a", block_size=4), FakeEngine("b", block_size=8)).connect()

    asyncio.run(main())
