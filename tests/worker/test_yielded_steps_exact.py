"""A step yielded to a short prompt behind a prompt in token chunks, on the tiny Llama: the short prompt
whole, the long prompt's chunk beside it in what it left, the streams' decodes, and every output equal
to transformers' greedy tokens, with the engine's async scheduling on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
from evenflow.core.sched.budget_controller import BudgetController

from tests.checkpoints import reference_greedy
from tests.worker.harness import Job, run_jobs
from tests.worker.scenarios import Runners

ALLOWANCE = 24  # prompt tokens a step beside decodes: a 5-token prompt leaves 19, over the 16-token floor


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunk_beside_a_short_prompt_gives_the_reference_tokens(runners: Runners, tiny_llama: Path, overlap: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BudgetController, "prefill_allowance",
                        lambda self, survey: ALLOWANCE if survey.decodes else 4096)
    runner = runners.get(4, {})
    jobs = [Job(f"s{i}", [3 + i, 9, 27, 81, 200 - i], 40) for i in range(3)]
    jobs += [Job("long", [(7 * t + 5) % 250 + 1 for t in range(120)], 5, arrive_step=6),
             Job("short", [17, 4, 99, 23, 5], 4, arrive_step=8),
             Job("short-2", [(11 * t + 2) % 250 + 1 for t in range(6)], 3, arrive_step=10)]
    result = run_jobs(runner, jobs, num_blocks=160, budget=256, overlap=overlap,
                      scheduler_overrides={"target_itl_ms": 50.0})
    for job in jobs:
        assert result.outputs[job.req_id] == reference_greedy(tiny_llama, job.prompt, job.max_tokens), job.req_id
    for short, length in (("short", 5), ("short-2", 6)):
        step = next(so for so in result.steps if so.num_scheduled_tokens.get(short, 0) > 1)
        assert step.num_scheduled_tokens[short] == length  # whole
        assert step.num_scheduled_tokens["long"] == ALLOWANCE - length  # the chunk in the room it left
