"""The adaptive budget's metrics, rendered from the engine's stats and read back by a Prometheus parser."""

from __future__ import annotations

from evenflow.frontend.metrics import FrontendMetrics
from evenflow.protocol import SchedulerStats, TokenBudgetStats
from prometheus_client.parser import text_string_to_metric_families


def test_budget_metrics_parse_and_carry_the_engine_numbers() -> None:
    m = FrontendMetrics("demo")
    counts = [0] * 17
    counts[5], counts[9] = 3, 1  # three budgets in (16, 32], one in (256, 512]
    m.set_engine_stats(SchedulerStats(budget=TokenBudgetStats(
        target_itl_s=0.05, token_budget=300, token_budget_log2_counts=counts, token_budget_sum=3 * 20 + 300,
        step_predicted_s=0.4, step_measured_s=0.5, num_controlled_steps=4, num_steps_within_target=3)))
    families = {f.name: f for f in text_string_to_metric_families(m.render())}
    value = {s.name + str(sorted(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert families["evenflow:token_budget_tokens"].type == "histogram"
    label = [("model_name", "demo")]
    assert value["evenflow:target_itl_seconds" + str(label)] == 0.05
    assert value["evenflow:token_budget" + str(label)] == 300
    assert value["evenflow:token_budget_tokens_bucket" + str(sorted(label + [("le", "16")]))] == 0
    assert value["evenflow:token_budget_tokens_bucket" + str(sorted(label + [("le", "32")]))] == 3
    assert value["evenflow:token_budget_tokens_bucket" + str(sorted(label + [("le", "+Inf")]))] == 4
    assert value["evenflow:token_budget_tokens_sum" + str(label)] == 360
    assert value["evenflow:step_time_predicted_seconds_total" + str(label)] == 0.4
    assert value["evenflow:step_time_measured_seconds_total" + str(label)] == 0.5
    assert value["evenflow:target_steps_within_ratio" + str(label)] == 0.75
