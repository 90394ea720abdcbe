"""Greedy outputs with LoRA adapters equal transformers + peft, token for token, in float32.

Every run mixes base-model requests with two or three adapters in the same steps, with chunked
prefill (a small budget), prefix-cache hits (repeated prompts), preemption (a small cache), and
overlap on and off, all through the real scheduler and the model runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.protocol.lora import LoRAConfig
from tests.lora_adapters import adapter_ref, peft_greedy
from tests.worker.harness import Job, RunResult, make_runner, run_jobs
from tests.worker.test_runner_correctness import make_prompt

MAX_TOKENS = 6


def lora_jobs(adapters: dict[str, Path], names: list[str | None], prompts: list[list[int]],
              max_tokens: int = MAX_TOKENS, stagger: bool = True) -> list[Job]:
    return [Job(f"j{i}-{name or 'base'}", prompt, max_tokens, arrive_step=i % 3 if stagger else 0,
                lora=None if name is None else adapter_ref(name, adapters[name]))
            for i, (name, prompt) in enumerate(zip(names, prompts))]


def check_against_peft(model_dir: Path, adapters: dict[str, Path], jobs: list[Job], result: RunResult) -> None:
    for job in jobs:
        adapter = None if job.lora is None else adapters[job.lora.name]
        assert result.outputs[job.req_id] == peft_greedy(model_dir, adapter, job.prompt, job.max_tokens), job.req_id


def run(model_dir: Path, jobs: list[Job], num_blocks: int, budget: int, max_loras: int, overlap: bool,
        max_cpu_loras: int | None = None, max_model_len: int | None = None) -> RunResult:
    runner = make_runner(model_dir, num_blocks=num_blocks, max_num_seqs=8,
                         lora_config=LoRAConfig(max_loras, 8, max_cpu_loras or max_loras))
    try:
        return run_jobs(runner, jobs, num_blocks=num_blocks, budget=budget, overlap=overlap,
                        max_model_len=max_model_len, scheduler_overrides={"max_loras": max_loras, "max_num_seqs": 8})
    finally:
        runner.shutdown()


def distinct_adapters_per_step(result: RunResult, jobs: list[Job]) -> list[int]:
    by_id = {j.req_id: j.lora for j in jobs}
    return [len({by_id[r].identity for r in so.num_scheduled_tokens if by_id[r] is not None})
            for so in result.steps]


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_with_chunks_and_prefix_hits_match_peft(tiny_llama: Path, lora_adapters: dict[str, Path],
                                                           overlap: bool) -> None:
    shared = make_prompt(7, 21)
    names = [None, "all", "attn", "mlp", "all", None, "attn"]
    prompts = [shared, shared, shared, make_prompt(8, 13), shared + [3, 4], make_prompt(9, 30), shared]
    jobs = lora_jobs(lora_adapters, names, prompts)
    result = run(tiny_llama, jobs, num_blocks=96, budget=7, max_loras=3, overlap=overlap)
    check_against_peft(tiny_llama, lora_adapters, jobs, result)
    assert result.mixed_steps > 0  # decodes and prefill chunks of several adapters in one step
    assert max(distinct_adapters_per_step(result, jobs)) >= 2


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_with_adapters_matches_peft(tiny_llama: Path, lora_adapters: dict[str, Path],
                                               overlap: bool) -> None:
    # 10 blocks of 8 tokens cannot hold three requests growing to 40+ tokens each.
    names = ["all", None, "attn"]
    jobs = lora_jobs(lora_adapters, names, [make_prompt(20 + i, 20 + 3 * i) for i in range(3)], 24, stagger=False)
    result = run(tiny_llama, jobs, num_blocks=10, budget=32, max_loras=3, overlap=overlap,
                 max_model_len=64)
    assert result.num_preemptions > 0
    assert any(c.resumed_from_preemption for step in result.steps for c in step.scheduled_cached_reqs)
    check_against_peft(tiny_llama, lora_adapters, jobs, result)


def test_more_adapters_than_slots_wait_their_turn_and_evict_lru(tiny_llama: Path,
                                                                 lora_adapters: dict[str, Path]) -> None:
    """max_loras=2 with three adapters: no step holds more than two, every request still matches
    peft (slots and host memory are reused in LRU order)."""
    names = ["all", "attn", "mlp", None, "mlp", "all"]
    jobs = lora_jobs(lora_adapters, names, [make_prompt(40 + i, 9 + i) for i in range(6)])
    result = run(tiny_llama, jobs, num_blocks=96, budget=32, max_loras=2, overlap=True, max_cpu_loras=2)
    check_against_peft(tiny_llama, lora_adapters, jobs, result)
    assert max(distinct_adapters_per_step(result, jobs)) == 2
