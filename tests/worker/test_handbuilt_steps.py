"""The runner driven by hand-built SchedulerOutputs: preemption by recompute into new blocks,
authoritative num_computed_tokens, finished/preempted bookkeeping and the empty step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from evenflow.protocol import CachedRequestData, NewRequestData, SchedulerOutput

from tests.checkpoints import reference_greedy
from tests.worker.harness import greedy, make_runner


def step(step_id: int, sched: dict[str, int], new: list[NewRequestData] | None = None,
         cached: list[CachedRequestData] | None = None, finished: list[str] | None = None,
         preempted: list[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(step_id, new or [], cached or [], sched, sum(sched.values()),
                           finished_req_ids=finished or [], preempted_req_ids=preempted or [])


def test_preempted_request_resumes_into_new_blocks(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=32, block_size=4)
    prompt = [5, 17, 99, 23, 42, 7, 8, 150, 61, 3]
    want = reference_greedy(tiny_llama, prompt, 8)
    out = runner.execute_model(step(0, {"r": 10}, new=[NewRequestData("r", prompt, greedy(8), [0, 1, 2], 0)]))
    tokens = out.sampled_token_ids[0]
    out = runner.execute_model(step(1, {"r": 1}, cached=[CachedRequestData("r", [], 10)]))
    tokens += out.sampled_token_ids[0]
    # Preempted: the worker keeps its 12 tokens; nothing runs this step.
    out = runner.execute_model(step(2, {}, preempted=["r"]))
    assert out.req_ids == [] and runner.batch.requests["r"].num_tokens == 12
    # Resumed in other blocks, recomputing 12 tokens in two chunks (the first samples nothing).
    out = runner.execute_model(step(3, {"r": 7}, cached=[CachedRequestData("r", [20, 21], 0, True)]))
    assert out.sampled_token_ids == [[]]
    out = runner.execute_model(step(4, {"r": 5}, cached=[CachedRequestData("r", [22], 7)]))
    tokens += out.sampled_token_ids[0]
    for i in range(5, 10):
        blocks = [23] if (len(prompt) + len(tokens) - 1) % 4 == 0 else []
        computed = len(prompt) + len(tokens) - 1
        out = runner.execute_model(step(i, {"r": 1}, cached=[CachedRequestData("r", blocks, computed)]))
        tokens += out.sampled_token_ids[0]
    assert tokens == want
    runner.execute_model(step(10, {}, finished=["r"]))
    assert runner.batch.requests == {}
    assert len(runner.batch._free_rows) == runner.batch.token_ids.shape[0]


def test_prepare_inputs_layout(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=32, block_size=4)
    batch = runner.batch
    so = step(0, {"p": 6, "d": 1},
              new=[NewRequestData("p", list(range(10, 20)), greedy(4), [3, 4, 5], 0),
                   NewRequestData("d", [7, 8, 9, 11, 12], greedy(4), [9, 8], 4)])
    batch.update(so)
    inputs = batch.prepare_inputs(so)
    assert [r.req_id for r in inputs.requests] == ["d", "p"]  # decodes first
    assert inputs.input_ids.tolist() == [12, 10, 11, 12, 13, 14, 15]
    assert inputs.positions.tolist() == [4, 0, 1, 2, 3, 4, 5]
    assert inputs.attn.query_start_loc.tolist() == [0, 1, 7]
    assert inputs.attn.seq_lens.tolist() == [5, 6]
    # d: position 4 -> block 8, offset 0; p: positions 0..5 -> blocks 3, 3, 3, 3, 4, 4.
    assert inputs.attn.slot_mapping.tolist() == [32, 12, 13, 14, 15, 16, 17]
    assert np.array_equal(inputs.attn.block_table_np, np.array([[9, 8], [3, 4]]))
    assert inputs.logits_indices.tolist() == [0]  # p's chunk stops short of its prompt's end
    assert inputs.sample_mask.tolist() == [True, False]
