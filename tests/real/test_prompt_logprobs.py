"""prompt_logprobs on the real model (SmolLM2-135M-Instruct GGUF, float32) against transformers'
``log_softmax`` over the same prompt: every prompt token's logprob and rank, and the top-k at its
position, at budgets that cut the prompt into chunks, next to a request that would hit the prefix
cache (the prompt-logprobs request reads none of it, as in vLLM V1), and through preemption (each
prompt token reported once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import PromptLogprobs, SamplingParams
from evenflow.worker.runner import ModelRunner
from tests.real.test_smollm2_reference import QUESTIONS, chat_ids
from tests.worker.harness import Job, make_runner, run_jobs

# Both sides float32; the kernels' rounding differs (6.9e-05 seen for sampled-token logprobs).
LOGPROB_TOLERANCE = 2e-3
TOP_K = 5


@pytest.fixture(scope="module")
def runner(smollm2_gguf: Path) -> ModelRunner:
    return make_runner(smollm2_gguf, num_blocks=64, block_size=16, max_model_len=512)


def reference_logprobs(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at positions 0..P-2: row i is the distribution of prompt token i+1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_matches(rows: PromptLogprobs, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    assert len(rows.token_ids) == len(rows.logprobs) == len(rows.ranks) == len(prompt) - 1
    errors = []
    for i, (ids, values, rank) in enumerate(zip(rows.token_ids, rows.logprobs, rows.ranks)):
        want = expected[i]
        assert ids[0] == prompt[i + 1]
        assert len(ids) == k + 1
        want_top = torch.topk(want, k + 1)  # one more: a near-tie at the k-th place may swap too
        # Tokens within the tolerance of each other may swap places; otherwise the same, in order.
        if k == 0 or (want_top.values[:-1] - want_top.values[1:]).min() > LOGPROB_TOLERANCE:
            assert ids[1:] == want_top.indices[:k].tolist(), i
        true_rank = int((want > want[prompt[i + 1]] + LOGPROB_TOLERANCE).sum()) + 1
        assert true_rank <= rank <= int((want > want[prompt[i + 1]] - LOGPROB_TOLERANCE).sum()) + 1, i
        errors.append(np.abs(np.array(values) - want[ids].numpy()).max())
    assert max(errors) < LOGPROB_TOLERANCE, max(errors)


@pytest.mark.parametrize("budget", [2048, 17])
def test_prompt_logprobs_equal_transformers(runner: ModelRunner, smollm2_tokenizer: Tokenizer, hf_model: Any,
                                            budget: int) -> None:
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[0])
    assert len(prompt) > 4 * 17  # budget 17 cuts it into five chunks or more
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP_K)
    result = run_jobs(runner, [Job("plp", prompt, 3, params=params)], num_blocks=64, budget=budget)
    chunks = [s.num_scheduled_tokens["plp"] for s in result.steps if "plp" in s.num_scheduled_tokens]
    assert (len(chunks) > 5) == (budget == 17)
    assert_matches(result.prompt_logprobs["plp"], prompt, reference_logprobs(hf_model, prompt), TOP_K)


def test_no_prefix_cache_read_and_k_zero(runner: ModelRunner, smollm2_tokenizer: Tokenizer, hf_model: Any) -> None:
    """A request sharing a cached system prompt still computes (and reports) every position; its
    neighbour without prompt_logprobs reads the cache."""
    first = Job("warm", chat_ids(smollm2_tokenizer, QUESTIONS[1]), 2)
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[2])
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    asking = Job("ask", prompt, 2, arrive_step=8, params=params)
    plain = Job("plain", prompt, 2, arrive_step=8)
    result = run_jobs(runner, [first, asking, plain], num_blocks=64, budget=64)
    new = {r.req_id: r for s in result.steps for r in s.scheduled_new_reqs}
    assert new["ask"].num_computed_tokens == 0 and new["plain"].num_computed_tokens > 0
    assert set(result.prompt_logprobs) == {"ask"}
    assert_matches(result.prompt_logprobs["ask"], prompt, reference_logprobs(hf_model, prompt), 0)


def test_preempted_requests_report_each_prompt_token_once(runner: ModelRunner, smollm2_tokenizer: Tokenizer,
                                                          hf_model: Any) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    jobs = [Job(f"pre-{i}", chat_ids(smollm2_tokenizer, q), 24, params=params) for i, q in enumerate(QUESTIONS)]
    # 10 blocks of 16 tokens cannot hold three requests growing to ~105 tokens each.
    result = run_jobs(runner, jobs, num_blocks=10, budget=64, max_model_len=160)
    assert result.num_preemptions > 0
    for j in jobs:
        assert_matches(result.prompt_logprobs[j.req_id], j.prompt, reference_logprobs(hf_model, j.prompt), 2)
