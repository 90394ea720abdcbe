"""The speculative decoding counters in /metrics, with vLLM's names."""

from __future__ import annotations

from evenflow.frontend.metrics import FrontendMetrics
from evenflow.protocol import SchedulerStats, SpecDecodingStats


def test_spec_decode_counters_are_rendered() -> None:
    m = FrontendMetrics("demo")
    m.set_engine_stats(SchedulerStats(spec_decode=SpecDecodingStats(
        num_drafts=4, num_draft_tokens=10, num_accepted_tokens=6, num_accepted_tokens_per_pos=[4, 2, 0])))
    values = {}
    for line in m.render().splitlines():
        if line.startswith("evenflow:spec_decode"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    for name, value in [("drafts", 4), ("draft_tokens", 10), ("accepted_tokens", 6)]:
        assert values[f'evenflow:spec_decode_num_{name}_total{{model_name="demo"}}'] == value
    for position, value in enumerate([4, 2, 0]):
        assert values[f'evenflow:spec_decode_num_accepted_tokens_per_pos_total{{model_name="demo",position="{position}"}}'] == value


def test_data_parallel_totals_add_per_position_counts() -> None:
    from evenflow.frontend.clients.data_parallel import sum_stats

    total = sum_stats([SchedulerStats(spec_decode=SpecDecodingStats(num_drafts=2, num_accepted_tokens_per_pos=[3, 1])),
                       SchedulerStats(spec_decode=SpecDecodingStats(num_drafts=1, num_accepted_tokens_per_pos=[1, 1, 1]))])
    assert total.spec_decode.num_drafts == 3 and total.spec_decode.num_accepted_tokens_per_pos == [4, 2, 1]
