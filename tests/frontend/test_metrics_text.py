"""Prometheus text and the merge of N frontends' snapshots (each request counted once)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from evenflow.frontend.engine_metrics import ENGINE_METRICS, stats_log_line
from evenflow.frontend.metrics import TTFT_BUCKETS, FrontendMetrics, merge_snapshots, render_prometheus
from evenflow.protocol import KVCacheStats, SchedulerCounts, SchedulerStats, WorkerTimingStats


def _serve_one(m: FrontendMetrics, tokens: int, reason: str) -> None:
    t = m.on_request_start(prompt_tokens=10, arrival=100.0)
    m.on_tokens(t, 1, 100.2)
    m.on_tokens(t, tokens - 1, 100.3)
    m.on_finish(t, reason, 100.5)


def _value(text: str, name: str, **labels: str) -> float:
    """The one sample named ``name`` with (at least) ``labels``."""
    [value] = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items()]
    return value


def test_render_has_every_family_and_valid_histograms() -> None:
    m = FrontendMetrics("demo")
    _serve_one(m, 5, "length")
    m.set_engine_stats(SchedulerStats(
        scheduler=SchedulerCounts(num_running=2, num_waiting=1, num_preemptions=3, num_steps=7, num_prompt_tokens=30,
                                  num_generation_tokens=12, num_scheduled_tokens=45),
        kv_cache=KVCacheStats(usage=0.25, prefix_cache_queries=100, prefix_cache_hits=40),
        workers=WorkerTimingStats(forward_s=1.5)))
    text = m.render()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]:
        assert f"# TYPE evenflow:{name} " in text, name
    assert _value(text, "evenflow:num_requests_running", model_name="demo") == 2
    assert _value(text, "evenflow:kv_cache_usage_perc") == 0.25
    assert _value(text, "evenflow:num_steps_total") == 7
    assert _value(text, "evenflow:scheduled_tokens_total") == 45  # the engine's sum of steps, not prompt + sampled
    assert _value(text, "evenflow:worker_forward_seconds_total") == 1.5
    assert _value(text, "evenflow:generation_tokens_total") == 5
    assert _value(text, "evenflow:request_success_total", model_name="demo", finished_reason="length") == 1
    assert _value(text, "evenflow:time_to_first_token_seconds_bucket", le="0.25", model_name="demo") == 1
    assert _value(text, "evenflow:time_to_first_token_seconds_bucket", le="0.1", model_name="demo") == 0
    assert _value(text, "evenflow:time_to_first_token_seconds_bucket", le="+Inf", model_name="demo") == 1
    assert abs(_value(text, "evenflow:e2e_request_latency_seconds_sum") - 0.5) < 1e-9
    assert _value(text, "evenflow:inter_token_latency_seconds_count") == 1


def test_two_frontends_sum_requests_and_share_engine_stats(tmp_path: Path) -> None:
    a = FrontendMetrics("demo", str(tmp_path), "frontend-0")
    b = FrontendMetrics("demo", str(tmp_path), "frontend-1")
    _serve_one(a, 4, "stop")
    _serve_one(b, 6, "stop")
    _serve_one(b, 2, "abort")
    a.set_engine_stats(SchedulerStats(scheduler=SchedulerCounts(num_running=1)), when=1.0)
    b.set_engine_stats(SchedulerStats(scheduler=SchedulerCounts(num_running=7)), when=2.0)  # fresher
    a.write_snapshot()
    b.write_snapshot()
    for scraped in (a.render(), b.render()):  # whichever frontend the scrape lands on
        assert _value(scraped, "evenflow:generation_tokens_total") == 12
        assert _value(scraped, "evenflow:prompt_tokens_total") == 30
        assert _value(scraped, "evenflow:request_success_total", model_name="demo", finished_reason="stop") == 2
        assert _value(scraped, "evenflow:request_success_total", model_name="demo", finished_reason="abort") == 1
        assert _value(scraped, "evenflow:num_requests_running") == 7
        assert _value(scraped, "evenflow:e2e_request_latency_seconds_count") == 3


def test_merge_skips_a_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "frontend-9.json").write_text("{half")
    m = FrontendMetrics("demo", str(tmp_path), "frontend-0")
    _serve_one(m, 3, "length")
    assert _value(m.render(), "evenflow:generation_tokens_total") == 3
    assert merge_snapshots([]).counters["evenflow:prompt_tokens_total"] == 0
    assert "model_name=\"a\\\"b\"" in render_prometheus(merge_snapshots([]), 'a"b')


def test_every_declared_metric_is_exposed_with_vllm_buckets() -> None:
    families = {f.name: f for f in text_string_to_metric_families(FrontendMetrics("demo").render())}
    for m in ENGINE_METRICS:  # a counter family is named without its _total suffix
        assert families[m.name.removesuffix("_total")].type == m.kind, m.name
    ttft = families["evenflow:time_to_first_token_seconds"]
    bounds = [float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")]
    assert bounds == [*TTFT_BUCKETS, float("inf")]  # vLLM's bounds, so its dashboards read ours


def test_log_line_only_with_activity() -> None:
    idle = SchedulerStats()
    assert stats_log_line(idle, idle, 10.0) is None
    busy = SchedulerStats(scheduler=SchedulerCounts(num_running=3, num_generation_tokens=500, num_prompt_tokens=100),
                          kv_cache=KVCacheStats(usage=0.5))
    line = stats_log_line(idle, busy, 10.0)
    assert line is not None and "50.0 tokens/s" in line and "Running: 3 reqs" in line and "KV cache usage: 50.0%" in line


def test_prompt_tokens_count_at_the_first_token_so_refused_requests_do_not() -> None:
    m = FrontendMetrics("demo")
    refused = m.on_request_start(100, arrival=0.0)  # overloaded: the engine answers no token
    m.on_finish(refused, "abort", now=0.1)
    served = m.on_request_start(7, arrival=0.0)
    assert m.counters["evenflow:prompt_tokens_total"] == 0  # nothing prefilled yet
    m.on_tokens(served, 1, now=0.2)
    m.on_tokens(served, 1, now=0.3)
    assert m.counters["evenflow:prompt_tokens_total"] == 7


def test_metrics_label_hides_the_models_filesystem_path() -> None:
    from evenflow.frontend.api.server import metrics_model_label

    assert metrics_model_label("/srv/models/smollm2-f32") == "smollm2-f32"
    assert metrics_model_label("./models/tiny/") == "tiny"
    assert metrics_model_label("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert metrics_model_label("demo") == "demo"
