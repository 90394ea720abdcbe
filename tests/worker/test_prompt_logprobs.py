"""prompt_logprobs through the scheduler and the runner on the tiny Llama, against transformers'
log_softmax over the prompt (float32): every prompt token once, at budgets that cut the prompt into
chunks, with overlap on and off, next to a request that reads the prefix cache. The real model's
version is tests/real/test_prompt_logprobs.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evenflow.protocol import SamplingParams
from tests.worker.harness import Job, run_jobs
from tests.worker.scenarios import Runners

TOLERANCE = 1e-4  # float32 both sides, a 2-layer model
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(45)]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].double(), dim=-1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [2048, 7])
def test_rows_equal_transformers(runners: Runners, expected: torch.Tensor, budget: int, overlap: bool) -> None:
    k = 3
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    # "warm" caches the first blocks of the prompt; "ask" must not read them, "plain" does.
    jobs = [Job("warm", PROMPT[:40], 2), Job("ask", PROMPT, 2, arrive_step=12, params=params),
            Job("plain", PROMPT, 2, arrive_step=12)]
    result = run_jobs(runners.get(8, {}), jobs, num_blocks=64, budget=budget, overlap=overlap)
    new = {r.req_id: r for s in result.steps for r in s.scheduled_new_reqs}
    assert new["ask"].num_computed_tokens == 0 and new["plain"].num_computed_tokens > 0
    assert set(result.prompt_logprobs) == {"ask"}
    rows = result.prompt_logprobs["ask"]
    assert [ids[0] for ids in rows.token_ids] == PROMPT[1:]
    top = torch.topk(expected, k)
    assert [ids[1:] for ids in rows.token_ids] == top.indices.tolist()
    want = np.take_along_axis(expected.numpy(), np.array(rows.token_ids), axis=1)
    assert np.abs(np.array(rows.logprobs) - want).max() < TOLERANCE
    target = expected.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))
    assert rows.ranks == ((expected > target).sum(dim=1) + 1).tolist()
