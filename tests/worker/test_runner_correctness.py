"""The model runner against transformers, token for token (float32, greedy), driven by the real
scheduler: single requests, mixed batches, chunked prefill, prefix-cache hits, preemption, overlap."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import reference_greedy
from tests.worker.harness import Job, make_runner, run_jobs


def make_prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    return make_runner(tiny_llama, num_blocks=256, block_size=8)


def expect(model_dir: Path, jobs: list[Job]) -> dict[str, list[int]]:
    return {j.req_id: reference_greedy(model_dir, j.prompt, j.max_tokens) for j in jobs}


@pytest.mark.parametrize("length", [1, 7, 16, 45])
def test_single_request_matches_reference(runner: ModelRunner, tiny_llama: Path, length: int) -> None:
    jobs = [Job(f"single-{length}", make_prompt(length, length), 12)]
    assert run_jobs(runner, jobs, num_blocks=256).outputs == expect(tiny_llama, jobs)


def test_batch_of_mixed_lengths(runner: ModelRunner, tiny_llama: Path) -> None:
    jobs = [Job(f"mixed-{n}", make_prompt(100 + n, n), 10) for n in (3, 30, 9, 64, 17, 1)]
    result = run_jobs(runner, jobs, num_blocks=256)
    assert len(result.steps[0].num_scheduled_tokens) == len(jobs)  # all prefilled in one step
    assert result.outputs == expect(tiny_llama, jobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_budget_7_mixes_decodes_and_prefills(runner: ModelRunner, tiny_llama: Path,
                                                             overlap: bool) -> None:
    jobs = [
        Job(f"chunk-a-{overlap}", make_prompt(1, 13), 14),
        Job(f"chunk-b-{overlap}", make_prompt(2, 29), 9, arrive_step=3),
        Job(f"chunk-c-{overlap}", make_prompt(3, 5), 6, arrive_step=5),
    ]
    result = run_jobs(runner, jobs, num_blocks=256, budget=7, overlap=overlap)
    assert max(s.total_num_scheduled_tokens for s in result.steps) <= 7
    assert result.mixed_steps > 0
    assert result.outputs == expect(tiny_llama, jobs)


def test_prefix_cache_hit_computes_only_the_tail(runner: ModelRunner, tiny_llama: Path) -> None:
    shared = make_prompt(7, 40)
    first = Job("prefix-first", shared + [5, 6, 7], 6)
    second = Job("prefix-second", shared + [9, 10, 11, 12, 13], 6, arrive_step=10)
    result = run_jobs(runner, [first, second], num_blocks=256)
    new_second = [r for s in result.steps for r in s.scheduled_new_reqs if r.req_id == "prefix-second"][0]
    assert new_second.num_computed_tokens == 40  # 5 full blocks of 8 came from the cache
    step = next(s for s in result.steps if any(r.req_id == "prefix-second" for r in s.scheduled_new_reqs))
    assert step.num_scheduled_tokens["prefix-second"] == len(second.prompt) - 40
    assert result.outputs == expect(tiny_llama, [first, second])


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_resumption(runner: ModelRunner, tiny_llama: Path, overlap: bool) -> None:
    # 10 blocks of 8 tokens cannot hold three requests growing to 40+ tokens each.
    jobs = [Job(f"preempt-{i}-{overlap}", make_prompt(20 + i, 20 + 3 * i), 24) for i in range(3)]
    result = run_jobs(runner, jobs, num_blocks=10, budget=32, overlap=overlap, max_model_len=64)
    assert result.num_preemptions > 0
    assert any(c.resumed_from_preemption for s in result.steps for c in s.scheduled_cached_reqs)
    assert result.outputs == expect(tiny_llama, jobs)
