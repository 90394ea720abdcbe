"""Chunk and block boundaries with n-gram speculative decoding: the real runner (tiny float32
Llama) and the real scheduler, against plain transformers greedy.

``scenarios.check`` asserts the outputs equal the reference (speculation changes no greedy token),
that a request samples only when its chunk reaches its known end before its draft slots, and that
a step emits at most 1 + slots tokens. Each case also asserts that drafts were really verified.
"""

from __future__ import annotations

import pytest

from evenflow.protocol import SpeculativeConfig
from tests.worker.harness import Job, RunResult
from tests.worker.scenarios import References, Runners, Scenario, check, tokens
from tests.worker.test_chunk_boundaries import chunks_of, only_resumption

K = 3
SPEC = SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None)
SPEC_RUNNER: dict[str, object] = {"speculative_config": SPEC}
LOOP = 133  # this random model answers a run of 133s with more 133s: drafts from it are accepted


def looping_prompt(length: int, tail_seed: int = 7) -> list[int]:
    """A run of LOOP ending in two other tokens: the proposer drafts from the run at once, some
    drafts are accepted and some rejected (found by search for every case in this file)."""
    return [LOOP] * (length - 2) + tokens(tail_seed, 2)


def verified_drafts(result: RunResult, req_id: str, after_step: int = -1) -> int:
    """Drafts the worker verified for ``req_id`` in the steps after ``after_step``."""
    total = 0
    for so, mro in zip(result.steps, result.runner_outputs):
        if so.step_id > after_step and mro.num_draft_tokens is not None and req_id in mro.req_ids:
            total += mro.num_draft_tokens[mro.req_ids.index(req_id)]
    return total


def draft_slots(result: RunResult, req_id: str) -> list[int]:
    """Draft slots the scheduler reserved for ``req_id``, per step that scheduled any."""
    return [s.num_draft_slots[req_id] for s in result.steps if req_id in s.num_draft_slots]


# ------------------------------------------------------------------ prompt length vs budget


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [7, 13])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_spec_prompt_of_k_budgets_plus_delta(runners: Runners, references: References, budget: int, k: int,
                                             delta: int, overlap: bool) -> None:
    """A prompt of k*budget-1, k*budget, k*budget+1 tokens, then decodes with drafts: the prefill
    chunks are untouched by speculation (no slot before the prompt's last chunk has sampled)."""
    length = k * budget + delta
    job = Job("p", looping_prompt(length), 16)
    result = check(runners, references, Scenario([job], budget=budget, overlap=overlap, runner_overrides=SPEC_RUNNER))
    full, rest = divmod(length, budget)
    prefill = [budget] * full + [rest] * (rest > 0)
    assert chunks_of(result, "p")[: len(prefill)] == prefill
    assert not any("p" in s.num_draft_slots for s in result.steps[: len(prefill)])
    assert 0 < result.num_accepted_drafts < result.num_draft_tokens  # some accepted, some rejected


# ------------------------------------------------------------------ drafts near max_model_len

# A 20-token prompt of LOOP (every draft accepted): the slots per decode step, cut so that the
# 1 + slots tokens a step may emit never pass max_model_len.
CUTS = [
    pytest.param(23, [1], id="cut-to-1"),
    pytest.param(24, [2], id="cut-to-2"),
    pytest.param(25, [3], id="exactly-K"),
    pytest.param(26, [3, 0], id="K-then-none"),
    pytest.param(27, [3, 1], id="K-then-1"),
]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_model_len, slots", CUTS)
def test_drafts_are_cut_at_max_model_len(runners: Runners, references: References, max_model_len: int,
                                         slots: list[int], overlap: bool) -> None:
    job = Job("p", [LOOP] * 20, 30)
    scenario = Scenario([job], max_model_len=max_model_len, overlap=overlap, runner_overrides=SPEC_RUNNER)
    result = check(runners, references, scenario)  # outputs stop at max_model_len - 20 tokens
    assert draft_slots(result, "p") == [n for n in slots if n]
    assert [s.num_scheduled_tokens["p"] for s in result.steps if "p" in s.num_scheduled_tokens][1:] == \
        [1 + n for n in slots]
    assert result.num_accepted_drafts == result.num_draft_tokens == sum(slots)


# ------------------------------------------------------------------ preemption vs block size

# Found by search over small pools: request "b" is preempted, resumes with ``known`` tokens
# (prompt + outputs) of which the prefix cache holds ``hit`` (all but the block of the last
# token), and then verifies drafts. Block size 4, max_model_len = pool.
RESUMES = [
    # len_a, len_b, max_tokens, num_blocks, budget, overlap, known, hit
    pytest.param(7, 7, 8, 6, 8, False, 12, 8, id="whole-blocks-recompute-last-block"),
    pytest.param(8, 8, 8, 5, 8, True, 8, 4, id="whole-blocks-recompute-last-block-overlap"),
    pytest.param(8, 7, 8, 6, 8, False, 9, 8, id="one-past-a-block"),
    pytest.param(5, 8, 6, 5, 8, True, 9, 8, id="one-past-a-block-overlap"),
    pytest.param(5, 7, 8, 5, 16, False, 11, 8, id="one-short-of-a-block"),
    pytest.param(9, 7, 10, 7, 8, True, 11, 8, id="one-short-of-a-block-overlap"),
]


@pytest.mark.parametrize("len_a, len_b, max_tokens, num_blocks, budget, overlap, known, hit", RESUMES)
def test_spec_preempted_request_resumes_at_a_block_boundary(
        runners: Runners, references: References, len_a: int, len_b: int, max_tokens: int, num_blocks: int,
        budget: int, overlap: bool, known: int, hit: int) -> None:
    block_size = 4
    # b starts with other tokens, so that it shares no block with a.
    jobs = [Job("a", looping_prompt(len_a), max_tokens),
            Job("b", tokens(2, 2) + looping_prompt(len_b - 2, tail_seed=3), max_tokens)]
    scenario = Scenario(jobs, block_size=block_size, budget=budget, num_blocks=num_blocks,
                        max_model_len=num_blocks * block_size, overlap=overlap, runner_overrides=SPEC_RUNNER)
    result = check(runners, references, scenario)
    step, resume = only_resumption(result, "b")
    assert resume.num_computed_tokens == hit == (known - 1) // block_size * block_size
    # The resumed chunk computes exactly what the cache lacks, and drafts nothing.
    assert step.num_scheduled_tokens["b"] == known - hit
    assert "b" not in step.num_draft_slots
    assert verified_drafts(result, "b", after_step=step.step_id) > 0
    assert result.num_accepted_drafts > 0
