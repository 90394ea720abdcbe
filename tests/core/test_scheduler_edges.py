"""Edges of the scheduler's behaviour, each pinned by the smallest case that reaches it."""

from __future__ import annotations

from evenflow.protocol import ModelRunnerOutput, SpeculativeConfig

from .test_scheduler import add, make_scheduler


def test_drafts_are_cut_at_max_model_len() -> None:
    """Draft slots stop where the tokens they may emit (1 + k) would pass max_model_len."""
    scheduler = make_scheduler(max_model_len=9, num_kv_blocks=4, block_size=4,
                               speculative_config=SpeculativeConfig("ngram", 3))
    request = add(scheduler, "a", 6)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, ["a"], [[7]], spec_token_ids=[[1, 2, 3]]))
    assert request.num_tokens == 7 and request.spec_token_ids == [1, 2, 3]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 2}  # position 6 and one draft: up to 9 tokens
    assert output.scheduled_spec_decode_tokens == {"a": [-1]}
    assert request.num_computed_tokens == 8


def test_aborting_a_request_never_scheduled_reports_no_cached_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 8)
    (out,) = scheduler.abort_requests(["a"])
    assert out.finish_reason == "abort" and out.num_cached_tokens == 0 and out.new_token_ids == []


def test_stats_report_prefix_cache_queries_and_hits() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 8)
    scheduler.schedule()
    add(scheduler, "b", 8)
    scheduler.schedule()  # b finds a's first block; its last token is always recomputed
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16, 4)


def test_long_prefill_threshold_of_one_token_prefills_one_token_a_step() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=1)
    add(scheduler, "a", 3)
    assert [scheduler.schedule().num_scheduled_tokens for _ in range(3)] == [{"a": 1}] * 3
