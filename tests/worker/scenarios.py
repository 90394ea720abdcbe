"""Scenarios for the real model runner driven by the real scheduler, checked against transformers.

A ``Scenario`` is everything one run needs: the scheduler's shape (budget, block size, KV pool,
max_model_len, overlap, prefix caching, any other SchedulerConfig field) and the jobs. ``check``
runs it and asserts every greedy output equals the reference token for token, and that a request
samples only in the steps whose chunk reached the end of its known tokens.

Both the property test and the deterministic boundary cases go through ``check``. To cover a new
mechanism, add its knobs here rather than a new harness:
- speculative decoding: put the worker's option in ``runner_overrides`` (a WorkerConfig field,
  e.g. the draft method) and any scheduler one in ``scheduler_overrides``; greedy outputs must
  still equal the plain reference, so ``References.expected`` applies unchanged, and the sample
  check below must then allow several tokens per step (``sampled_per_step``).
- grammars: give the job ``params`` with the structured-output field set and a ``reference``
  (a callable prompt, max_tokens -> tokens) computing transformers greedy under the same
  constraint; ``References.expected`` uses it instead of plain greedy.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evenflow.worker.runner import ModelRunner

from tests.checkpoints import reference_greedy
from tests.worker.harness import Job, RunResult, make_runner, run_jobs

RUNNER_MAX_MODEL_LEN = 128  # every runner's tables; a scenario's scheduler may use less
VOCAB = 256
_PREFIX_POOL = [random.Random(1000 + i).choices(range(3, VOCAB), k=RUNNER_MAX_MODEL_LEN) for i in range(2)]


def tokens(seed: int, length: int) -> list[int]:
    """``length`` deterministic ids in 3..255 (0-2 are pad/bos/eos in the tiny configs)."""
    return random.Random(seed).choices(range(3, VOCAB), k=length)


def shared_prefix(index: int, length: int) -> list[int]:
    """The first ``length`` ids of one of two long fixed sequences, for prefix-cache hits."""
    return _PREFIX_POOL[index][:length]


@dataclass
class Scenario:
    jobs: list[Job]
    block_size: int = 8
    budget: int = 2048
    num_blocks: int = 64
    max_model_len: int = RUNNER_MAX_MODEL_LEN
    overlap: bool = False
    prefix_caching: bool = True
    scheduler_overrides: dict[str, object] = field(default_factory=dict)
    runner_overrides: dict[str, object] = field(default_factory=dict)
    # Per-job reference (e.g. constrained greedy for a grammar); default: plain transformers greedy.
    references: dict[str, Callable[[list[int], int], list[int]]] = field(default_factory=dict)


def expected_num_outputs(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Output length of an ignore_eos request: max_tokens, cut at max_model_len total tokens.

    A prompt of exactly max_model_len still samples its one token (Request.check_stop).
    """
    return min(max_tokens, max(1, max_model_len - prompt_len))


class References:
    """Transformers greedy continuations, computed once per distinct prompt and reused.

    Greedy continuations are prefixes of each other, so a longer one answers shorter requests.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        key = tuple(prompt)
        known = self._greedy.get(key, [])
        if len(known) < num_tokens:
            known = reference_greedy(self.model_dir, prompt, num_tokens)
            self._greedy[key] = known
        return known[:num_tokens]

    def expected(self, scenario: Scenario) -> dict[str, list[int]]:
        out = {}
        for job in scenario.jobs:
            n = expected_num_outputs(len(job.prompt), job.max_tokens, scenario.max_model_len)
            reference = scenario.references.get(job.req_id, self.greedy)
            out[job.req_id] = reference(job.prompt, n)
        return out


class Runners:
    """One ModelRunner per (block size, worker options), built on first use (loading is the slow part)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._runners: dict[tuple[int, tuple[tuple[str, object], ...]], ModelRunner] = {}

    def get(self, block_size: int, overrides: dict[str, object]) -> ModelRunner:
        key = (block_size, tuple(sorted(overrides.items())))
        if key not in self._runners:
            self._runners[key] = make_runner(self.model_dir, num_blocks=8, block_size=block_size,
                                             max_model_len=RUNNER_MAX_MODEL_LEN, **overrides)
        return self._runners[key]


def check(runners: Runners, references: References, scenario: Scenario) -> RunResult:
    """Run ``scenario``; assert outputs equal the references and samples come only at chunk ends."""
    runner = runners.get(scenario.block_size, scenario.runner_overrides)
    result = run_jobs(runner, scenario.jobs, num_blocks=scenario.num_blocks, budget=scenario.budget,
                      overlap=scenario.overlap, enable_prefix_caching=scenario.prefix_caching,
                      max_model_len=scenario.max_model_len, scheduler_overrides=scenario.scheduler_overrides)
    assert result.outputs == references.expected(scenario), scenario
    assert_samples_only_at_chunk_ends(result)
    assert_every_step_within_budget(result, scenario.budget)
    return result


def assert_samples_only_at_chunk_ends(result: RunResult) -> None:
    """A request samples exactly when its scheduled tokens reach the end of what it knows.

    Replays each request's length from the steps: the prompt, plus one token per sample; a chunk
    that ends before that length (a partial prefill) must sample nothing.
    """
    known: dict[str, int] = {}
    computed: dict[str, int] = {}
    for so, mro in zip(result.steps, result.runner_outputs):
        for new in so.scheduled_new_reqs:
            known[new.req_id] = len(new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        for req_id, sampled in zip(mro.req_ids, mro.sampled_token_ids):
            end = computed[req_id] + so.num_scheduled_tokens[req_id]
            # Steps are replayed in order, so an in-flight sample (overlap) is already counted.
            assert end <= known[req_id], (so.step_id, req_id, end, known[req_id])
            assert bool(sampled) == (end == known[req_id]), (so.step_id, req_id, end, known[req_id], sampled)
            assert len(sampled) <= 1
            known[req_id] += len(sampled)


def assert_every_step_within_budget(result: RunResult, budget: int) -> None:
    assert all(0 < s.total_num_scheduled_tokens <= budget for s in result.steps if s.num_scheduled_tokens)
