"""Scenarios for the real model runner driven by the real scheduler, checked against transformers.

A ``Scenario`` is everything one run needs: the scheduler's shape (budget, block size, KV pool,
max_model_len, overlap, prefix caching, any other SchedulerConfig field) and the jobs. ``check``
runs it and asserts every greedy output equals the reference token for token, and that a request
samples only in the steps whose chunk reached the end of its known tokens.

Both the property test and the deterministic boundary cases go through ``check``. To cover a new
mechanism, add its knobs here rather than a new harness. Two are wired so far:
- speculative decoding (test_chunk_boundaries_spec.py): ``runner_overrides`` carries the
  worker's ``speculative_config`` (``run_jobs`` hands it to the scheduler too); greedy outputs
  must still equal the plain reference. The sample check reads each step's draft slots: a chunk
  samples when it reaches the known end *before* its drafts, and emits 1 to 1 + slots tokens.
- grammars (test_chunk_boundaries_grammar.py): the job's ``params`` set ``structured_outputs``,
  ``structured_output`` is the scheduler's grammar manager, and ``references[req_id]`` computes
  transformers greedy under the same constraint (``References.expected`` uses it instead).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evenflow.core.sched.structured_output import StructuredOutputManager
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
    structured_output: StructuredOutputManager | None = None  # for jobs whose params set a grammar


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
        self._runners: dict[tuple[int, tuple[tuple[str, str], ...]], ModelRunner] = {}

    def get(self, block_size: int, overrides: dict[str, object]) -> ModelRunner:
        # Keyed by repr: some options (SpeculativeConfig, a msgspec Struct) are not hashable.
        key = (block_size, tuple(sorted((name, repr(value)) for name, value in overrides.items())))
        if key not in self._runners:
            self._runners[key] = make_runner(self.model_dir, num_blocks=8, block_size=block_size,
                                             max_model_len=RUNNER_MAX_MODEL_LEN, **overrides)
        return self._runners[key]


def check(runners: Runners, references: References, scenario: Scenario) -> RunResult:
    """Run ``scenario``; assert outputs equal the references and samples come only at chunk ends."""
    runner = runners.get(scenario.block_size, scenario.runner_overrides)
    result = run_jobs(runner, scenario.jobs, num_blocks=scenario.num_blocks, budget=scenario.budget,
                      overlap=scenario.overlap, enable_prefix_caching=scenario.prefix_caching,
                      max_model_len=scenario.max_model_len, scheduler_overrides=scenario.scheduler_overrides,
                      structured_output=scenario.structured_output)
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
            # With overlap the engine counts a step's drafts as computed before it hears which
            # were rejected; the worker trusts it only up to the last known token (batch.py).
            computed[cached.req_id] = min(cached.num_computed_tokens, known[cached.req_id] - 1)
        for req_id, sampled in zip(mro.req_ids, mro.sampled_token_ids):
            # Draft slots come after the known tokens; a step verifying d drafts emits 1..d+1.
            num_slots = so.num_draft_slots.get(req_id, 0)
            end = computed[req_id] + so.num_scheduled_tokens[req_id] - num_slots
            # Steps are replayed in order, so an in-flight sample (overlap) is already counted.
            assert end <= known[req_id], (so.step_id, req_id, end, known[req_id])
            assert bool(sampled) == (end == known[req_id]), (so.step_id, req_id, end, known[req_id], sampled)
            assert len(sampled) <= 1 + num_slots, (so.step_id, req_id, num_slots, sampled)
            known[req_id] += len(sampled)


def assert_every_step_within_budget(result: RunResult, budget: int) -> None:
    assert all(0 < s.total_num_scheduled_tokens <= budget for s in result.steps if s.num_scheduled_tokens)
