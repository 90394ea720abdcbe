"""SchedulerStats on the wire: one array per owner, so a field one owner adds moves nobody else's."""

from __future__ import annotations

import msgspec
from msgspec import field

from evenflow.protocol import (
    Codec, EngineToFrontend, GrammarStats, KVCacheStats, Outputs, SchedulerCounts, SchedulerStats, SpecDecodingStats,
    TokenBudgetStats, WorkerTimingStats,
)


class _NewerKVCacheStats(KVCacheStats, array_like=True):
    """The KV cache's part as a later engine might send it: one field appended."""

    num_offloaded_blocks: int = 0


# SchedulerStats as a later engine might send it: that KV part, and a new owner's part appended.
_NewerSchedulerStats = msgspec.defstruct(
    "_NewerSchedulerStats",
    [(f.name, _NewerKVCacheStats, field(default_factory=_NewerKVCacheStats)) if f.name == "kv_cache"
     else (f.name, f.type, field(default_factory=f.default_factory)) for f in msgspec.structs.fields(SchedulerStats)]
    + [("lora", list[int], field(default_factory=list))],
    array_like=True,
)


def _full() -> SchedulerStats:
    return SchedulerStats(
        scheduler=SchedulerCounts(num_running=2, num_waiting=1, num_preemptions=3, num_steps=4, num_prompt_tokens=5,
                                  num_generation_tokens=6, num_scheduled_tokens=7, schedule_s=0.5, update_s=0.25,
                                  num_layered_prefills=8, num_layer_group_steps=9, num_layered_prefills_stopped=1),
        kv_cache=KVCacheStats(usage=0.5, prefix_cache_queries=10, prefix_cache_hits=4),
        workers=WorkerTimingStats(prepare_s=1.0, forward_s=2.0, sample_s=3.0, idle_s=4.0, num_contended_steps=2),
        grammar=GrammarStats(compile_buckets=[1, 0, 2], compile_s=0.125, cache_hits=1),
        budget=TokenBudgetStats(target_itl_s=0.05, token_budget=300, token_budget_log2_counts=[0, 1],
                                token_budget_sum=300, step_predicted_s=0.1, step_measured_s=0.2,
                                num_controlled_steps=2, num_steps_within_target=1),
        spec_decode=SpecDecodingStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1,
                                      num_accepted_tokens_per_pos=[1, 0]),
    )


def test_each_owner_is_one_array_in_order() -> None:
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(_full()))
    assert wire == [[2, 1, 3, 4, 5, 6, 7, 0.5, 0.25, 8, 9, 1], [0.5, 10, 4], [1.0, 2.0, 3.0, 4.0, 2], [[1, 0, 2], 0.125, 1],
                    [0.05, 300, [0, 1], 300, 0.1, 0.2, 2, 1], [1, 2, 1, [1, 0]]]


def test_a_field_or_part_a_later_engine_appends_moves_no_other_field() -> None:
    newer = _NewerSchedulerStats(**{name: getattr(_full(), name) for name in SchedulerStats.__struct_fields__
                                    if name != "kv_cache"},
                                 kv_cache=_NewerKVCacheStats(0.5, 10, 4, num_offloaded_blocks=9), lora=[3])
    frame = Codec(EngineToFrontend).encode(Outputs([], newer, 1.0))  # type: ignore[arg-type]
    decoded = Codec(EngineToFrontend).decode(frame)
    assert isinstance(decoded, Outputs) and decoded.stats == _full()


def test_an_older_engines_shorter_parts_take_their_defaults() -> None:
    older = [[2, 1], [0.5], [], [[1]], [0.05], [1, 2]]  # as if each part then ended there
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(older), type=SchedulerStats)
    assert (stats.scheduler.num_running, stats.scheduler.num_waiting, stats.scheduler.update_s) == (2, 1, 0.0)
    assert stats.kv_cache == KVCacheStats(usage=0.5) and stats.workers == WorkerTimingStats()
    assert stats.grammar.compile_buckets == [1] and stats.budget.target_itl_s == 0.05
    assert stats.spec_decode == SpecDecodingStats(num_drafts=1, num_draft_tokens=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([]), type=SchedulerStats) == SchedulerStats()
