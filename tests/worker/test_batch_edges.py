"""PersistentBatch on its own (no model): the row tables' growth and reuse, the max_model_len
edges of the tables, the bookkeeping of preempted, finished, re-sent and resumed requests, the
refusal of a step past a request's known tokens, and the step inputs' dtypes.

These are the paths the model-runner tests never reach (found by mutation testing of
evenflow/worker/batch.py, see docs/mutation.md); each test drives the batch with hand-built
SchedulerOutputs the way the runner does (``update`` then ``prepare_inputs``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from evenflow.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from evenflow.worker.batch import PersistentBatch, RequestState

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def new(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, prompt, GREEDY, blocks, computed)


def step(step_id: int, sched: dict[str, int], new_reqs: list[NewRequestData] | None = None,
         cached: list[CachedRequestData] | None = None, finished: list[str] | None = None,
         preempted: list[str] | None = None, spec: dict[str, int] | None = None) -> SchedulerOutput:
    return SchedulerOutput(step_id, new_reqs or [], cached or [], sched, sum(sched.values()),
                           num_draft_slots=spec or {}, finished_req_ids=finished or [],
                           preempted_req_ids=preempted or [])


def row(batch: PersistentBatch, state: RequestState) -> list[int]:
    """The request's tokens as its row of the table holds them."""
    return batch.token_ids[state.row, : state.num_tokens].tolist()


def test_more_live_requests_than_rows_grow_the_tables_and_keep_every_row_apart() -> None:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=CPU)
    prompts = {f"r{i}": [10 * i + j for j in range(1, 4 + i)] for i in range(5)}
    blocks = {f"r{i}": [2 * i + 1, 2 * i + 2] for i in range(5)}
    so = step(0, {r: len(p) for r, p in prompts.items()}, [new(r, p, blocks[r]) for r, p in prompts.items()])
    batch.update(so)
    states = batch.requests
    # Doubled once (2 -> 4 -> 8 rows), every new row used before growing again.
    assert sorted(s.row for s in states.values()) == [0, 1, 2, 3, 4]
    assert batch.token_ids.shape[0] == batch.block_table.shape[0] == 8
    for r, s in states.items():
        assert row(batch, s) == prompts[r]
        assert batch.block_table[s.row, :2].tolist() == blocks[r]
    inputs = batch.prepare_inputs(so)
    assert inputs.input_ids.tolist() == [t for s in inputs.requests for t in prompts[s.req_id]]
    want_slots = [blocks[s.req_id][p // 4] * 4 + p % 4 for s in inputs.requests for p in range(len(prompts[s.req_id]))]
    assert inputs.attn.slot_mapping.tolist() == want_slots


def test_a_prompt_of_max_model_len_fits_with_its_sampled_token_and_all_its_blocks() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    prompt = list(range(100, 116))
    so = step(0, {"r": 16}, [new("r", prompt, [5, 6, 7, 8])])
    batch.update(so)
    inputs = batch.prepare_inputs(so)
    assert inputs.sample_mask.tolist() == [True] and inputs.logits_indices.tolist() == [15]
    state = batch.requests["r"]
    batch.append_sampled([state], np.array([99]))
    # The sampled token is stored after the prompt (column max_model_len), not over its end.
    assert row(batch, state) == prompt + [99]
    assert state.output_token_ids == [99]


def test_tokens_past_the_table_still_reach_the_output_list() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=8, block_size=4, device=CPU)
    batch.update(step(0, {"r": 8}, [new("r", list(range(1, 9)), [1, 2])]))
    state = batch.requests["r"]
    # Two tokens at once from a full row: the second has no column; it must not raise.
    batch.append_sampled([state], np.array([50, 51]), np.array([2]))
    assert state.output_token_ids == [50, 51]
    assert batch.token_ids[state.row, :8].tolist() == list(range(1, 9))


def test_the_tables_refuse_tokens_or_blocks_past_their_room_by_request() -> None:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=CPU)
    # max_model_len + 1 tokens (a full prompt and its sample) resume; one more is refused.
    full = new("full", list(range(16)), [1, 2, 3, 4])
    batch.update(step(0, {"full": 16}, [full]))
    batch.append_sampled([batch.requests["full"]], np.array([7]))
    batch.update(step(1, {}, preempted=["full"]))
    batch.update(step(2, {"full": 16}, cached=[CachedRequestData("full", [9, 10, 11, 12, 13], 0, True)]))
    assert row(batch, batch.requests["full"]) == list(range(16)) + [7]
    with pytest.raises(ValueError, match="request long has 18 tokens, over max_model_len"):
        batch.update(step(3, {"long": 18}, [new("long", list(range(18)), [1])]))
    # Blocks: room for those of max_model_len + 1 tokens (5 of 4 tokens), not one more.
    with pytest.raises(ValueError, match="request full has 6 KV blocks, over max_model_len"):
        batch.update(step(4, {"full": 1}, cached=[CachedRequestData("full", [14], 16)]))


def test_the_sampling_state_reads_the_requests_own_prompt_and_output_lists() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"r": 5}, [new("r", [9, 3, 9, 4, 3], [1, 2])]))
    state = batch.requests["r"]
    batch.append_sampled([state], np.array([11]))
    # Penalties read these: the prompt's distinct ids and every token sampled so far.
    assert state.sampling.prompt_unique_ids(vocab_size=32).tolist() == [3, 4, 9]
    assert state.sampling.output_ids().tolist() == [11]


def test_a_preempted_requests_row_goes_to_the_next_new_request() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"a": 4}, [new("a", [1, 2, 3, 4], [1])]))
    batch.append_sampled([batch.requests["a"]], np.array([5]))
    batch.update(step(1, {"b": 3}, [new("b", [7, 8, 9], [2])], preempted=["a"]))
    assert batch.requests["b"].row == 0 and batch.token_ids.shape[0] == 1
    batch.update(step(2, {"a": 5}, cached=[CachedRequestData("a", [3, 4], 0, True)], finished=["b"]))
    assert batch.requests["a"].row == 0 and row(batch, batch.requests["a"]) == [1, 2, 3, 4, 5]
    assert batch.token_ids.shape[0] == 1


def test_unknown_ids_among_finished_or_preempted_are_ignored() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"a": 2}, [new("a", [1, 2], [1])]))
    batch.update(step(1, {}, finished=["ghost"], preempted=["ghost2"]))
    assert list(batch.requests) == ["a"] and batch.requests["a"].row == 0


def test_a_request_sent_again_as_new_replaces_its_state_in_its_freed_row() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"a": 3}, [new("a", [1, 2, 3], [1])]))
    batch.update(step(1, {"a": 2}, [new("a", [8, 9], [4])]))
    state = batch.requests["a"]
    assert state.prompt_token_ids == [8, 9] and row(batch, state) == [8, 9]
    assert state.row == 0 and batch.token_ids.shape[0] == 1


def test_an_unknown_cached_request_is_refused_by_name() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    with pytest.raises(ValueError, match="step 3: unknown request 'x' in scheduled_cached_reqs"):
        batch.update(step(3, {"x": 1}, cached=[CachedRequestData("x", [], 0)]))


def test_a_request_resumed_while_holding_its_row_gets_the_new_block_table_in_place() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"a": 6}, [new("a", [1, 2, 3, 4, 5, 6], [1, 2])]))
    # Resumed with no preemption notice: its blocks are replaced, its row kept.
    so = step(1, {"a": 6}, cached=[CachedRequestData("a", [7, 8], 0, True)])
    batch.update(so)
    inputs = batch.prepare_inputs(so)
    assert batch.requests["a"].row == 0 and batch.token_ids.shape[0] == 1
    assert inputs.attn.block_table_np.tolist() == [[7, 8]]
    assert inputs.attn.slot_mapping.tolist() == [28, 29, 30, 31, 32, 33]


def test_a_resumed_request_verifies_no_drafts_from_before_its_preemption() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"a": 6}, [new("a", [1, 2, 3, 4, 5, 6], [1, 2])]))
    state = batch.requests["a"]
    batch.append_sampled([state], np.array([7]))
    batch.token_ids[state.row, 7:9] = [8, 9]  # two drafts, as the proposer leaves them
    state.num_drafts = 2
    batch.update(step(1, {}, preempted=["a"]))
    # Resumed in one chunk that samples, with two blind draft slots: the old drafts are gone.
    so = step(2, {"a": 9}, cached=[CachedRequestData("a", [3, 4], 0, True)], spec={"a": 2})
    batch.update(so)
    inputs = batch.prepare_inputs(so)
    assert inputs.num_drafts.tolist() == [0]
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert inputs.logits_indices.tolist() == [6]


def test_a_step_past_known_tokens_without_draft_slots_is_refused_naming_the_request() -> None:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=CPU)
    batch.update(step(0, {"ok": 3, "bad": 6}, [new("ok", [1, 2, 3], [1]), new("bad", [1, 2, 3, 4, 5, 6], [2, 3])]))
    ok, bad = batch.requests["ok"], batch.requests["bad"]
    batch.append_sampled([ok, bad], np.array([4, 7]))
    bad.num_drafts = 2  # drafts stored, but the engine gave no slots for them
    so = step(1, {"ok": 1, "bad": 3}, cached=[CachedRequestData("ok", [], 3), CachedRequestData("bad", [], 6)])
    batch.update(so)
    with pytest.raises(ValueError, match="step 1: request bad scheduled past its 7 known tokens"):
        batch.prepare_inputs(so)


def test_step_inputs_have_the_dtypes_and_maxima_the_attention_kernels_take() -> None:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=CPU)
    so = step(0, {"p": 6, "d": 1}, [new("p", list(range(10, 20)), [3, 4, 5]), new("d", [7, 8, 9, 11, 12], [9, 8], 4)])
    batch.update(so)
    inputs = batch.prepare_inputs(so)
    attn = inputs.attn
    assert (attn.max_query_len, attn.max_seq_len) == (6, 6)
    assert attn.query_start_loc.dtype == attn.seq_lens.dtype == attn.block_table.dtype == torch.int32
    assert attn.slot_mapping.dtype == inputs.input_ids.dtype == inputs.positions.dtype == torch.int64
    assert inputs.logits_indices.dtype == torch.int64
