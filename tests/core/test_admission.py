"""Admission limits and deadlines as plain objects (the engine loop wiring is tested end to end)."""

from __future__ import annotations

from evenflow.core.admission import AdmissionLimits
from evenflow.core.deadlines import Deadlines, check_timeout
from evenflow.core.request import Request
from evenflow.protocol import SamplingParams


def _req(rid: str, prompt_len: int, computed: int = 0) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), [0])
    r.num_computed_tokens = computed
    return r


def test_no_limits_admit_everything() -> None:
    held = [_req(str(i), 100) for i in range(50)]
    assert AdmissionLimits().refusal(held, len(held), 10_000) is None


def test_request_limit_counts_waiting_and_running() -> None:
    limits = AdmissionLimits(max_num_queued_reqs=2)
    held = [_req("a", 5, computed=5), _req("b", 5)]
    assert limits.refusal(held[:1], 1, 3) is None
    why = limits.refusal(held, 2, 3)
    assert why is not None and why.startswith("max_num_queued_reqs:") and "2" in why


def test_token_limit_counts_only_prompt_tokens_not_yet_computed() -> None:
    limits = AdmissionLimits(max_num_queued_tokens=100)
    held = [_req("done", 80, computed=80), _req("half", 60, computed=30), _req("new", 40)]
    # queued = 0 + 30 + 40 = 70: a 30-token prompt fits exactly, 31 does not.
    assert limits.refusal(held, 3, 30) is None
    why = limits.refusal(held, 3, 31)
    assert why is not None and why.startswith("max_num_queued_tokens:") and "70" in why
    assert limits.refusal([], 0, 101) is not None  # a prompt alone over the limit can never be taken


def test_deadlines_pop_in_order_and_only_when_due() -> None:
    d = Deadlines()
    a, b, c = _req("a", 1), _req("b", 1), _req("c", 1)
    d.add(b, now=10.0, timeout_s=5.0)
    d.add(a, now=10.0, timeout_s=1.0)
    d.add(c, now=11.0, timeout_s=1.0)
    assert d.pop_expired(10.5) == []
    assert d.pop_expired(12.0) == [(a, 1.0), (c, 1.0)]
    assert len(d) == 1 and d.pop_expired(100.0) == [(b, 5.0)]


def test_timeout_values() -> None:
    assert check_timeout(0.0) is None and check_timeout(2.5) is None
    for bad in (-1.0, float("inf"), float("nan")):
        assert check_timeout(bad) is not None
