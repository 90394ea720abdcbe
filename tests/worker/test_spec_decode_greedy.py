"""Speculative decoding in the real runner, driven by the real scheduler: greedy token ids equal
transformers' (and so equal speculation off) for K in {1, 3, 5}, with odd budgets, chunked prefill,
prefix caching, preemption, and overlap on and off; drafts must really be verified and accepted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from evenflow.protocol import SamplingParams, SpeculativeConfig
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import reference_greedy
from tests.worker.harness import Job, RunResult, make_runner, run_jobs


def copy_prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    """A prompt that repeats its own spans, so that n-gram lookups find matches."""
    rng = random.Random(seed)
    span = [rng.randrange(3, vocab) for _ in range(max(2, length // 3))]
    return (span * 4)[:length]


@pytest.fixture(scope="module", params=[1, 3, 5])
def spec_runner(request: pytest.FixtureRequest, tiny_llama: Path) -> ModelRunner:
    spec = SpeculativeConfig("ngram", request.param, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None)
    return make_runner(tiny_llama, num_blocks=256, block_size=8, speculative_config=spec)


def expect(model_dir: Path, jobs: list[Job]) -> dict[str, list[int]]:
    return {j.req_id: reference_greedy(model_dir, j.prompt, j.max_tokens) for j in jobs}


def num_slots(result: RunResult) -> int:
    return sum(n for s in result.steps for n in s.num_draft_slots.values())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [5, 13])
def test_greedy_equals_reference(spec_runner: ModelRunner, tiny_llama: Path, overlap: bool, budget: int) -> None:
    jobs = [
        # This random model's greedy output after copy_prompt(2, 12) falls into short loops.
        Job(f"a-{budget}-{overlap}", copy_prompt(2, 12), 50),
        Job(f"b-{budget}-{overlap}", copy_prompt(1, 11), 16, arrive_step=2),
        Job(f"c-{budget}-{overlap}", copy_prompt(3, 40), 12, arrive_step=4),
    ]
    result = run_jobs(spec_runner, jobs, num_blocks=256, budget=budget, overlap=overlap)
    assert max(s.total_num_scheduled_tokens for s in result.steps) <= budget
    assert num_slots(result) > 0 and 0 < result.num_accepted_drafts < result.num_draft_tokens
    assert result.outputs == expect(tiny_llama, jobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_with_preemption_and_prefix_cache(spec_runner: ModelRunner, tiny_llama: Path, overlap: bool) -> None:
    shared = copy_prompt(9, 24)
    jobs = [Job(f"p-{i}-{overlap}", shared + copy_prompt(20 + i, 6 + 3 * i), 24) for i in range(3)]
    result = run_jobs(spec_runner, jobs, num_blocks=10, budget=32, overlap=overlap, max_model_len=64)
    assert result.num_preemptions > 0
    assert result.outputs == expect(tiny_llama, jobs)


def test_every_emitted_token_has_its_logprobs(spec_runner: ModelRunner, tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    job = Job("logprobs", copy_prompt(2, 12), 30, params=params)
    result = run_jobs(spec_runner, [job], num_blocks=256, overlap=True)
    assert result.num_accepted_drafts > 0  # some steps emitted several tokens
    tokens, logprobs = result.outputs["logprobs"], result.logprobs["logprobs"]
    assert tokens == reference_greedy(tiny_llama, job.prompt, 30) and len(logprobs) == len(tokens)
    for token, lp in zip(tokens, logprobs):
        assert lp.token_ids[0] == token and lp.sampled_rank == 1 and len(lp.token_ids) == 3
        assert lp.token_ids[1] == token and lp.logprobs[0] == lp.logprobs[1]  # greedy: the top token


def test_disable_by_batch_size_stops_drafting_under_load(tiny_llama: Path) -> None:
    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=2)
    runner = make_runner(tiny_llama, num_blocks=256, block_size=8, speculative_config=spec)
    pair = [Job(f"load-{i}", copy_prompt(2, 12), 30) for i in range(2)]
    busy = run_jobs(runner, pair, num_blocks=256, overlap=True)
    assert busy.num_draft_tokens == 0 and not any(s.num_draft_slots for s in busy.steps)
    alone = run_jobs(runner, [Job("alone", copy_prompt(2, 12), 30)], num_blocks=256, overlap=True)
    assert alone.num_accepted_drafts > 0
    assert busy.outputs["load-0"] == busy.outputs["load-1"] == alone.outputs["alone"]
