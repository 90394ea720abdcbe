"""Property tests: random workloads through the scheduler with a fake deterministic model.

Whatever the arrivals, budgets, block sizes, pool sizes (down to pools that force preemption),
priorities and aborts, every request must end with exactly the tokens it produces alone, the
invariants in ``driver.check_invariants`` must hold after every step, and no block may leak.
"""

from __future__ import annotations

import dataclasses

import pytest
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import SamplingParams, SpeculativeConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .driver import PlannedRequest, run_workload
from .fake_model import EOS_TOKEN_ID, VOCAB_SIZE, reference_generate
from .synthetic_timing import SyntheticMachine

# The same properties with the step's prefill gated: a fixed budget only (the default path), the
# adaptive budget on a synthetic machine (targets from below a decode step to generous), and vLLM
# V0's partial-prefill bounds.
GATES = ["fixed", "target_itl", "partial_prefills"]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[PlannedRequest]]:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 80))
    min_blocks = -(-max_model_len // block_size)
    # Half the pools are barely big enough for one longest request: preemption is frequent.
    config = SchedulerConfig(
        num_kv_blocks=draw(
            st.one_of(st.integers(min_blocks, min_blocks + 2), st.integers(min_blocks, 3 * min_blocks + 4))
        ),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=max_model_len,
        block_size=block_size,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
    )
    # A few shared prefixes make prefix-cache hits (and shared blocks) common.
    prefixes = [draw(st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=0, max_size=40)) for _ in range(2)]
    plan = []
    for index in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30))
        prompt = (prefix + suffix)[:max_model_len]
        max_tokens = draw(st.integers(1, 24))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=2)),
            temperature=0.0,
        )
        aborted = draw(st.integers(0, 9)) == 0
        arrival = draw(st.integers(0, 12))
        plan.append(
            PlannedRequest(
                request_id=f"req-{index}",
                prompt=prompt,
                params=params,
                arrival_step=arrival,
                priority=draw(st.integers(0, 3)),
                abort_step=arrival + draw(st.integers(0, 15)) if aborted else None,
            )
        )
    return config, plan


def gated(config: SchedulerConfig, gate: str, draw_index: int) -> SchedulerConfig:
    """``config`` with the gate ``gate`` on; ``draw_index`` (drawn) picks its settings."""
    if gate == "target_itl":
        return dataclasses.replace(config, target_itl_ms=[0.5, 2.2, 3.0, 10.0][draw_index % 4])
    if gate == "partial_prefills":
        num_partial = 2 + draw_index % 2
        return dataclasses.replace(config, max_num_partial_prefills=num_partial,
                                   max_long_partial_prefills=1 + draw_index // 2 % num_partial)
    return config


def check_against_reference(config: SchedulerConfig, plan: list[PlannedRequest], max_in_flight: int) -> None:
    step_seconds = SyntheticMachine().step_seconds if config.target_itl_ms else None
    result = run_workload(Scheduler(config), plan, max_in_flight=max_in_flight, step_seconds=step_seconds)
    for planned in plan:
        expected = reference_generate(planned.prompt, planned.params, (EOS_TOKEN_ID,), config.max_model_len)
        got = result.tokens.get(planned.request_id, [])
        reason = result.finish_reasons[planned.request_id]
        if reason == "abort":
            assert got == expected.token_ids[: len(got)], planned.request_id
        else:
            assert (got, reason) == (expected.token_ids, expected.finish_reason), planned.request_id


@pytest.mark.parametrize("max_in_flight", [1, 2], ids=["one-step-in-flight", "two-steps-in-flight"])
@pytest.mark.parametrize("gate", GATES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), draw_index=st.integers(0, 7))
def test_random_workloads_match_reference(
    gate: str, max_in_flight: int, workload: tuple[SchedulerConfig, list[PlannedRequest]], draw_index: int
) -> None:
    config, plan = workload
    check_against_reference(gated(config, gate, draw_index), plan, max_in_flight=max_in_flight)


@st.composite
def workloads_with_drafts(draw: st.DrawFn) -> tuple[SchedulerConfig, list[PlannedRequest]]:
    """The same workloads with n-gram-style drafts: K slots per decode, sometimes off under load."""
    config, plan = draw(workloads())
    config.speculative_config = SpeculativeConfig(
        "ngram", draw(st.integers(1, 5)), disable_by_batch_size=draw(st.sampled_from([None, 2, 4]))
    )
    return config, plan


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads_with_drafts(), st.sampled_from([1, 2]))
def test_random_workloads_with_drafts(workload: tuple[SchedulerConfig, list[PlannedRequest]], max_in_flight: int) -> None:
    """Budget, blocks and tokens stay exact when decodes carry drafts that are partly rejected."""
    config, plan = workload
    check_against_reference(config, plan, max_in_flight=max_in_flight)


def test_a_request_preempted_by_an_unsent_step_and_finished_by_the_step_in_flight() -> None:
    """Found by the search above: with two steps in flight, req-6 is preempted (for req-8, priority
    policy) by a step with nothing to run, so its preemption waits for the next step sent, and the step
    in flight before it samples req-6's last token. The workers must hear it finished, not also
    preempted (the fake worker, strict, failed on its dropped block table)."""
    config = SchedulerConfig(num_kv_blocks=53, max_num_batched_tokens=5, max_num_seqs=3, max_model_len=31,
                             block_size=1, policy="priority", enable_prefix_caching=False)
    short = [19, 6, 7, 0]
    spec = [("req-0", short[:3] + [0] * 10, 18, 1, None), ("req-1", short, 1, 0, None),
            *[(f"req-{i}", short, 1, 0, 0) for i in range(2, 6)],
            ("req-6", [19, 6, 7, 11, 22, 43, 1], 18, 1, None), ("req-7", short, 1, 0, None),
            ("req-8", short, 10, 1, None)]
    plan = [PlannedRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0), 0, priority, abort)
            for rid, prompt, n, priority, abort in spec]
    check_against_reference(config, plan, max_in_flight=2)
