"""The persistent batch: per-request state kept across steps, and the step's flat varlen inputs.

Every request the worker knows has a ``RequestState``; the running ones also own a row of two
preallocated numpy tables: ``token_ids`` (prompt + sampled tokens, the worker's truth about what
each request contains) and ``block_table`` (physical KV block ids). SchedulerOutputs only carry
deltas (new requests once, then new block ids), which are applied to those rows; ``prepare_inputs``
then derives every per-token array with vectorized numpy indexing over the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from evenflow.protocol import AdapterRef, NewRequestData, SchedulerOutput
from evenflow.worker.attention.base import AttentionInputs
from evenflow.worker.layered_prefill import LayeredRows
from evenflow.worker.sampling_metadata import RequestSamplingState
from evenflow.worker.staging import HostStaging


@dataclass
class RequestState:
    """One request as the worker sees it."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the live list the sampler reads; grows by one per sampled step
    sampling: RequestSamplingState
    num_computed_tokens: int
    num_blocks: int = 0
    row: int = -1  # row in the batch tables; -1 while preempted
    # Drafts proposed after this request's last sample, kept in its row right after its known
    # tokens (see spec_decode.py); the next step verifies as many as the engine gave slots for.
    num_drafts: int = 0
    lora: AdapterRef | None = None  # its LoRA adapter (None: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """One step's model inputs. Requests are ordered decodes first (see attention/base.py)."""

    requests: list[RequestState]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [S] long: each sampling request's drafts' and last token's rows
    sample_mask: np.ndarray  # [num_reqs] bool: which requests sample this step
    num_drafts: np.ndarray  # [num_reqs] int64: drafts each request verifies (0 without speculation)
    layered: LayeredRows | None = None  # a prompt prefilled by layer groups: the step's last request


class PersistentBatch:
    """Request states plus the row tables they are mirrored in."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device,
                 num_layers: int = 0) -> None:
        self.block_size = block_size
        self.num_layers = num_layers  # where a layered prefill's last span ends (it samples there)
        self.device = device
        self.staging = HostStaging(device)
        # +1: the token sampled after the last computed position is stored but never computed.
        self.max_tokens = max_model_len + 1
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.token_ids = np.zeros((max_num_reqs, self.max_tokens), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    # ------------------------------------------------------------------ state updates

    def _take_row(self) -> int:
        if not self._free_rows:  # more live requests than max_num_seqs: grow rather than fail
            old = self.token_ids.shape[0]
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _release_row(self, state: RequestState) -> None:
        if state.row >= 0:
            self._free_rows.append(state.row)
            state.row = -1

    def _write_row(self, state: RequestState, block_ids: list[int]) -> None:
        """(Re)fill a request's row: all its tokens and a fresh block table."""
        if state.row < 0:
            state.row = self._take_row()
        n_prompt = len(state.prompt_token_ids)
        if state.num_tokens > self.max_tokens:
            raise ValueError(f"request {state.req_id} has {state.num_tokens} tokens, over max_model_len")
        self.token_ids[state.row, :n_prompt] = state.prompt_token_ids
        self.token_ids[state.row, n_prompt : state.num_tokens] = state.output_token_ids
        # Stale ids of the row's previous owner would be gathered (and masked) by attention
        # groups padded to a longer request; block 0 always exists.
        self.block_table[state.row] = 0
        state.num_blocks = 0
        state.num_drafts = 0  # resumed by recompute: a prefill first, drafts after its sample
        self._append_blocks(state, block_ids)

    def _append_blocks(self, state: RequestState, block_ids: list[int]) -> None:
        end = state.num_blocks + len(block_ids)
        if end > self.max_blocks:
            raise ValueError(f"request {state.req_id} has {end} KV blocks, over max_model_len")
        self.block_table[state.row, state.num_blocks : end] = block_ids
        state.num_blocks = end

    def _add_new(self, new: NewRequestData) -> RequestState:
        outputs: list[int] = []
        prompt = list(new.prompt_token_ids)
        sampling = RequestSamplingState.create(new.sampling_params, prompt, outputs, self.device)
        state = RequestState(new.req_id, prompt, outputs, sampling, new.num_computed_tokens, lora=new.lora)
        self.requests[new.req_id] = state
        self._write_row(state, new.block_ids)
        return state

    def update(self, so: SchedulerOutput) -> None:
        """Apply a SchedulerOutput's deltas: drop finished, park preempted, add new, extend running."""
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._release_row(state)
        for req_id in so.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                self._release_row(state)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:  # a re-sent request replaces the old state
                self._release_row(self.requests.pop(new.req_id))
            self._add_new(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise ValueError(f"step {so.step_id}: unknown request {cached.req_id!r} in scheduled_cached_reqs")
            if cached.resumed_from_preemption or state.row < 0:
                self._write_row(state, cached.new_block_ids)
            else:
                self._append_blocks(state, cached.new_block_ids)
            # The engine's count, except that with overlap it may not have seen the last step's
            # rejected drafts yet: a request's known tokens but its last always have KV.
            state.num_computed_tokens = min(cached.num_computed_tokens, state.num_tokens - 1)

    # ------------------------------------------------------------------ inputs

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Build the flat varlen inputs of the scheduled requests (decodes first)."""
        decodes: list[RequestState] = []
        others: list[RequestState] = []
        draft_slots = so.num_draft_slots
        # Draft slots the worker has no draft for are left out of the step (it proposed fewer).
        num_scheduled = {
            req_id: n - draft_slots[req_id] + min(draft_slots[req_id], self.requests[req_id].num_drafts)
            if req_id in draft_slots else n
            for req_id, n in so.num_scheduled_tokens.items()
        }
        layered = self._layered(so, num_scheduled)
        for req_id, n in num_scheduled.items():
            state = self.requests[req_id]
            if layered is None or req_id != layered.req_id:
                (decodes if n == 1 else others).append(state)
        # Decodes sorted by context length: the torch backend attends to them in a few
        # contiguous groups of similar length, padding each group only to its own longest.
        decodes.sort(key=_num_computed)
        reqs = decodes + others if layered is None else decodes + others + [self.requests[layered.req_id]]
        num_reqs = len(reqs)
        rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter((num_scheduled[s.req_id] for s in reqs), dtype=np.int64, count=num_reqs)
        computed = np.fromiter((s.num_computed_tokens for s in reqs), dtype=np.int64, count=num_reqs)
        num_tokens = np.fromiter((s.num_tokens for s in reqs), dtype=np.int64, count=num_reqs)
        seq_lens = computed + num_sched
        # Positions past the known tokens hold this step's drafts (written by the proposer).
        num_drafts = np.maximum(seq_lens - num_tokens, 0)
        if draft_slots and np.any(num_drafts > 0):
            drafted = np.fromiter((s.num_drafts for s in reqs), dtype=np.int64, count=num_reqs)
        else:
            drafted = np.zeros(num_reqs, dtype=np.int64)
        if np.any(num_drafts > drafted):
            bad = reqs[int(np.argmax(num_drafts > drafted))]
            raise ValueError(
                f"step {so.step_id}: request {bad.req_id} scheduled past its {bad.num_tokens} known tokens"
            )
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        req_of_token = np.repeat(np.arange(num_reqs), num_sched)
        positions = computed[req_of_token] + (np.arange(total) - query_start_loc[req_of_token])
        token_rows = rows[req_of_token]
        input_ids = self.token_ids[token_rows, positions]
        bs = self.block_size
        slots = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_seq_len = int(seq_lens.max())
        block_table = self.block_table[rows, : -(-max_seq_len // bs)]
        sample_mask = seq_lens >= num_tokens
        if layered is not None and not layered.final:
            sample_mask[-1] = False  # its rows leave the step before the last layer
        # Each sampling request needs logits at its last known token and at each of its drafts.
        num_logits = np.where(sample_mask, num_drafts + 1, 0)
        logits_cu = np.cumsum(num_logits)
        logits_indices = np.repeat(cu - num_logits, num_logits) + (
            np.arange(int(logits_cu[-1])) - np.repeat(logits_cu - num_logits, num_logits)
        )
        stage = self.staging.to_device
        self.staging.begin()
        seq_lens32 = seq_lens.astype(np.int32)
        attn = AttentionInputs(
            num_tokens=total,
            num_reqs=num_reqs,
            num_decodes=len(decodes),
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            block_size=bs,
            query_start_loc=stage("query_start_loc", query_start_loc),
            seq_lens=stage("seq_lens32", seq_lens32),
            block_table=stage("block_table", block_table),
            slot_mapping=stage("slots", slots),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens32,
            block_table_np=block_table,
        )
        step = StepInputs(
            requests=reqs,
            input_ids=stage("input_ids", input_ids),
            positions=stage("positions", positions),
            attn=attn,
            logits_indices=stage("logits_indices", logits_indices.astype(np.int64)),
            sample_mask=sample_mask,
            num_drafts=num_drafts,
            layered=layered,
        )
        self.staging.end()
        return step

    def _layered(self, so: SchedulerOutput, num_scheduled: dict[str, int]) -> LayeredRows | None:
        """The step's request prefilled by layer groups, checked (at most one, a span of the layers)."""
        if not so.layer_spans:
            return None
        if len(so.layer_spans) > 1:
            raise ValueError(f"step {so.step_id}: {len(so.layer_spans)} requests prefilled by layer groups, at most 1")
        (req_id, (start, end)), = so.layer_spans.items()
        if req_id not in num_scheduled or not 0 <= start < end <= self.num_layers:
            raise ValueError(f"step {so.step_id}: layer span [{start}, {end}) of {req_id!r} is not a span of "
                             f"the model's {self.num_layers} layers for a scheduled request")
        return LayeredRows(req_id, start, end, num_scheduled[req_id], end == self.num_layers)

    def append_sampled(self, sampled_reqs: list[RequestState], token_ids: np.ndarray,
                       num_emitted: np.ndarray | None = None) -> None:
        """Append each sampling request's new tokens (``num_emitted[i]`` of them, 1 when None,
        consecutive in ``token_ids``) to its list and its row."""
        if not sampled_reqs:
            return
        count = len(sampled_reqs)
        if num_emitted is None:
            num_emitted = np.ones(count, dtype=np.int64)
        rows = np.fromiter((s.row for s in sampled_reqs), dtype=np.int64, count=count)
        cols = np.fromiter((s.num_tokens for s in sampled_reqs), dtype=np.int64, count=count)
        starts = np.cumsum(num_emitted) - num_emitted
        offsets = np.arange(len(token_ids)) - np.repeat(starts, num_emitted)
        token_cols = np.minimum(np.repeat(cols, num_emitted) + offsets, self.max_tokens - 1)
        self.token_ids[np.repeat(rows, num_emitted), token_cols] = token_ids
        tokens = token_ids.tolist()
        for state, start, n in zip(sampled_reqs, starts.tolist(), num_emitted.tolist()):
            state.output_token_ids.extend(tokens[start : start + n])


def _num_computed(state: RequestState) -> int:
    return state.num_computed_tokens
