"""The real model runner at every chunk and block boundary, against transformers (greedy, float32).

Each case pins where a boundary falls (asserted from the steps), then ``scenarios.check`` asserts
the outputs equal the reference and a request samples only when its chunk reaches its end.
"""

from __future__ import annotations


import pytest

from evenflow.protocol import CachedRequestData, SchedulerOutput
from tests.worker.harness import Job, RunResult
from tests.worker.scenarios import References, Runners, Scenario, check, shared_prefix, tokens


def chunks_of(result: RunResult, req_id: str) -> list[int]:
    return [s.num_scheduled_tokens[req_id] for s in result.steps if req_id in s.num_scheduled_tokens]


def first_admission(result: RunResult, req_id: str) -> tuple[int, int]:
    """(tokens found in the prefix cache, tokens scheduled) in the step that admitted ``req_id``."""
    for step in result.steps:
        for new in step.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.num_computed_tokens, step.num_scheduled_tokens[req_id]
    raise AssertionError(f"{req_id} was never admitted")


def only_resumption(result: RunResult, req_id: str) -> tuple[SchedulerOutput, CachedRequestData]:
    """The step that resumed ``req_id`` after its preemption, and its resume, asserting that it was
    the one preemption of the run and happened once."""
    resumed = [(step, c) for step in result.steps for c in step.scheduled_cached_reqs if c.resumed_from_preemption]
    assert [c.req_id for _, c in resumed] == [req_id]
    return resumed[0]


# ------------------------------------------------------------------ prompt length vs budget


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [7, 29])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_prompt_of_k_budgets_plus_delta(runners: Runners, references: References, budget: int, k: int, delta: int,
                                        overlap: bool) -> None:
    """A prompt of k*budget-1, k*budget, k*budget+1 tokens: the last chunk is budget-1, budget or 1
    tokens, and only the chunk that ends the prompt samples (k*budget+1 ends a chunk at len-1)."""
    length = k * budget + delta
    job = Job("p", tokens(length, length), 5)
    result = check(runners, references, Scenario([job], budget=budget, overlap=overlap))
    full, rest = divmod(length, budget)
    assert chunks_of(result, "p") == [budget] * full + [rest] * (rest > 0) + [1] * 4


@pytest.mark.parametrize("overlap", [False, True])
def test_prefills_at_budget_boundaries_beside_running_decodes(runners: Runners, references: References,
                                                             overlap: bool) -> None:
    """The same lengths sharing steps with decodes: every chunk is budget minus the decodes."""
    budget = 8
    jobs = [Job("decoding", tokens(1, 3), 30)]
    jobs += [Job(f"len{n}", tokens(n, n), 4, arrive_step=2 + i) for i, n in enumerate((15, 16, 17, 23, 24, 25))]
    result = check(runners, references, Scenario(jobs, budget=budget, overlap=overlap))
    assert result.mixed_steps > 0
    assert max(s.total_num_scheduled_tokens for s in result.steps) == budget


# ------------------------------------------------------------------ prefix-cache hits vs block size


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("budget", [3, 2048])
def test_prefix_hit_ending_near_a_block_boundary(runners: Runners, references: References, block_size: int,
                                                 k: int, delta: int, budget: int) -> None:
    """Two prompts sharing k*block_size+delta tokens: the second finds only the full blocks."""
    shared = k * block_size + delta
    first = Job("first", shared_prefix(0, shared) + tokens(1, 5), 4)
    second = Job("second", shared_prefix(0, shared) + tokens(2, 3), 4, arrive_step=60)
    result = check(runners, references, Scenario([first, second], block_size=block_size, budget=budget))
    hit, scheduled = first_admission(result, "second")
    assert hit == shared // block_size * block_size
    assert scheduled == min(len(second.prompt) - hit, budget)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("arrive_step", [1, 60])
def test_fully_cached_prompt_recomputes_its_last_token(runners: Runners, references: References, delta: int,
                                                       arrive_step: int, overlap: bool) -> None:
    """The same prompt twice (k*block_size+delta tokens), the second while the first still runs
    (shared blocks) or after it finished: the last token is always computed again, for its logits,
    so a prompt of whole blocks recomputes its whole last block."""
    block_size = 8
    length = 3 * block_size + delta
    prompt = shared_prefix(1, length)
    jobs = [Job("first", prompt, 6), Job("again", prompt, 6, arrive_step=arrive_step)]
    result = check(runners, references, Scenario(jobs, block_size=block_size, overlap=overlap))
    hit, scheduled = first_admission(result, "again")
    assert hit == (length - 1) // block_size * block_size
    assert scheduled == length - hit


# ------------------------------------------------------------------ preemption vs block size

# Found by search over small pools: request "b" is preempted and resumes with ``known`` tokens
# (prompt + outputs) of which the prefix cache holds ``hit``. Block size 4, max_model_len = pool.
RESUMES = [
    # l_a, l_b, max_tokens, num_blocks, budget, overlap, known, hit
    pytest.param(5, 5, 10, 6, 8, False, 12, 8, id="whole-blocks-recompute-last-block"),
    pytest.param(5, 5, 10, 6, 8, True, 12, 8, id="whole-blocks-recompute-last-block-overlap"),
    pytest.param(5, 5, 6, 5, 8, False, 9, 8, id="one-past-a-block"),
    pytest.param(7, 8, 6, 5, 8, True, 9, 8, id="one-past-a-block-overlap"),
    pytest.param(5, 7, 6, 5, 16, False, 11, 8, id="one-short-of-a-block"),
    pytest.param(5, 7, 6, 5, 16, True, 11, 8, id="one-short-of-a-block-overlap"),
]


@pytest.mark.parametrize("len_a, len_b, max_tokens, num_blocks, budget, overlap, known, hit", RESUMES)
def test_preempted_request_resumes_at_a_block_boundary(runners: Runners, references: References, len_a: int,
                                                       len_b: int, max_tokens: int, num_blocks: int, budget: int,
                                                       overlap: bool, known: int, hit: int) -> None:
    block_size = 4
    jobs = [Job("a", tokens(1, len_a), max_tokens), Job("b", tokens(2, len_b), max_tokens)]
    scenario = Scenario(jobs, block_size=block_size, budget=budget, num_blocks=num_blocks,
                        max_model_len=num_blocks * block_size, overlap=overlap)
    result = check(runners, references, scenario)
    step, resume = only_resumption(result, "b")
    assert resume.num_computed_tokens == hit
    # The resumed chunk computes exactly what the cache lacks (``known`` tokens are prompt + outputs).
    assert step.num_scheduled_tokens["b"] == known - hit
