"""Property test: the real model runner and the real scheduler against transformers, greedy.

Hypothesis draws the step budget, block size, KV pool (down to pools that must preempt),
max_model_len (down to cutting outputs), overlap on/off, a long-prefill threshold, max_num_seqs,
and a few requests with arrival steps, prompt lengths (often k*budget-1, k*budget, k*budget+1)
and shared prefixes (often ending at k*block_size-1, k*block_size, k*block_size+1). Every output
must equal the transformers greedy continuation token for token (``scenarios.check``).

Derandomized: the same examples run every time, so a failure reproduces; hypothesis prints the
shrunk scenario.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.harness import Job, greedy
from tests.worker.scenarios import References, Runners, Scenario, check, shared_prefix, tokens

MAX_PROMPT = 64
MAX_TOKENS = 8


def near_multiples(unit: int, low: int, high: int) -> st.SearchStrategy[int]:
    """k*unit - 1, k*unit, k*unit + 1 for k >= 1, kept within [low, high]."""
    values = sorted({k * unit + d for k in range(1, high // max(unit, 1) + 2) for d in (-1, 0, 1)})
    values = [v for v in values if low <= v <= high]
    return st.sampled_from(values) if values else st.integers(low, high)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    budget = draw(st.one_of(st.integers(1, 12), st.integers(13, 72)))
    jobs = []
    for index in range(draw(st.integers(1, 4))):
        length = draw(st.one_of(st.integers(1, MAX_PROMPT), near_multiples(budget, 1, MAX_PROMPT)))
        prefix_len = draw(st.one_of(st.just(0), st.integers(0, length), near_multiples(block_size, 0, length)))
        prompt = shared_prefix(draw(st.integers(0, 1)), prefix_len) + tokens(draw(st.integers(0, 3)), length - prefix_len)
        max_tokens = draw(st.integers(1, MAX_TOKENS))
        jobs.append(Job(f"r{index}", prompt, max_tokens, arrive_step=draw(st.integers(0, 8)), params=greedy(max_tokens)))
    longest_prompt = max(len(j.prompt) for j in jobs)
    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    max_model_len = draw(st.one_of(st.just(longest), st.integers(longest_prompt, longest)))
    min_blocks = -(-max_model_len // block_size)
    # Half the pools barely hold one request of max_model_len: preemption is common.
    num_blocks = draw(st.one_of(st.integers(min_blocks, min_blocks + 2), st.integers(min_blocks, 4 * min_blocks)))
    return Scenario(
        jobs=jobs,
        block_size=block_size,
        budget=budget,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        overlap=draw(st.booleans()),
        prefix_caching=draw(st.sampled_from([True, True, False])),
        scheduler_overrides=dict(
            max_num_seqs=draw(st.sampled_from([1, 2, 256])),
            long_prefill_token_threshold=draw(st.sampled_from([0, 0, 0, 3, 8])),
        ),
    )


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_real_runner_matches_transformers_in_every_shape(runners: Runners, references: References,
                                                         scenario: Scenario) -> None:
    check(runners, references, scenario)
