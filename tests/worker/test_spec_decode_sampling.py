"""Random sampling with speculation: the distribution of tokens is unchanged, seeded requests
produce the very same tokens with speculation on and off and whatever shares their batch, and
every emitted token carries its logprobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from evenflow.protocol import SamplingParams, SpeculativeConfig
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import make_checkpoint
from tests.worker.harness import Job, make_runner, run_jobs
from tests.worker.test_sampler import CHI2_999

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # the suffix [1, 2] (and [3, 1, 2]) recur: drafts [3, 1, 2, ...]
SPEC = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None)  # draft at any load


@pytest.fixture(scope="module")
def small_vocab_model(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, seed=3, vocab_size=VOCAB)


def sample(model: Path, spec: SpeculativeConfig | None, seeds: range, max_tokens: int = 4, check_drafts: bool = True,
           **params: object) -> dict[str, list[int]]:
    """Sample ``seeds`` requests in one run; with ``spec``, check that drafts were accepted."""
    runner: ModelRunner = make_runner(model, num_blocks=512, block_size=8, speculative_config=spec)
    jobs = [Job(f"s{seed}", PROMPT, max_tokens,
                params=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **params))  # type: ignore[arg-type]
            for seed in seeds]
    result = run_jobs(runner, jobs, num_blocks=512, overlap=True)
    if spec is not None and check_drafts:
        assert 0 < result.num_accepted_drafts < result.num_draft_tokens, "drafts must be both accepted and rejected"
    outputs = result.outputs
    return {job.req_id: outputs[job.req_id] for job in jobs}


def test_seeded_tokens_identical_with_speculation_on_and_off(small_vocab_model: Path) -> None:
    seeds = range(40)
    on = sample(small_vocab_model, SPEC, seeds, temperature=0.8, top_k=4)
    assert on == sample(small_vocab_model, None, seeds, temperature=0.8, top_k=4)
    # In another batch (fewer neighbours, other arrivals) a seed still gives the same tokens.
    assert {k: v for k, v in on.items() if k in ("s3", "s17")} == sample(small_vocab_model, SPEC, range(3, 18, 14),
                                                                        check_drafts=False, temperature=0.8, top_k=4)


def test_token_distribution_unchanged_chi_square(small_vocab_model: Path) -> None:
    """Independent seeds with speculation on and off: the joint law of the 2nd and 3rd tokens
    (after drafts were accepted or rejected) is the same (chi-square homogeneity, 0.1% level)."""
    n = 600
    on = sample(small_vocab_model, SPEC, range(n), max_tokens=3)
    off = sample(small_vocab_model, None, range(10_000, 10_000 + n), max_tokens=3)
    table = np.zeros((2, VOCAB * VOCAB))
    for row, outputs in enumerate((on, off)):
        for tokens in outputs.values():
            table[row, tokens[1] * VOCAB + tokens[2]] += 1
    table = table[:, table.sum(axis=0) >= 10]  # cells with enough mass for the approximation
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    assert 3 <= dof <= len(CHI2_999)
    assert statistic < CHI2_999[dof - 1], (statistic, dof)
