"""A prompt prefilled by layer groups: its rows in a step, and its hidden state between steps.

The scheduler may run one prompt's tokens through a few of the model's layers per step, beside the
decodes that run through all of them (evenflow/core/sched/layered_prefill.py says why). Its rows are
the step's last ones; in the layers outside its span the step runs without them (an attention plan
of the other requests alone), and between its steps the worker keeps the residual stream of its
rows where the last span ended. Each row's computation is the one an unsplit prefill does: a layer
reads only its own K/V, which the span's steps write as they go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from evenflow.protocol import SchedulerOutput
from evenflow.worker.attention.base import AttentionInputs


@dataclass
class LayeredRows:
    """The step's request prefilled by layer groups: the last ``num_rows`` rows of the step."""

    req_id: str
    start: int  # its first layer this step
    end: int  # one past its last layer this step
    num_rows: int
    final: bool  # ``end`` is the model's last layer: it samples this step


@dataclass
class LayeredForward:
    """What the model's forward needs for a step with layered rows, and what it hands back."""

    rows: LayeredRows
    rest_plan: object  # the attention plan of the step's other requests, for the layers outside the span
    hidden_in: torch.Tensor | None  # the rows' residual stream before ``start`` (None when start == 0)
    hidden_out: torch.Tensor | None = field(default=None)  # after ``end``, when it is not the last layer

    @property
    def start(self) -> int:
        return self.rows.start

    @property
    def end(self) -> int:
        return self.rows.end

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows


def layered_boundary(i: int, x: torch.Tensor, delta: torch.Tensor | None, layered: LayeredForward,
                     full_plan: object, num_rest: int) -> tuple[torch.Tensor, None, object]:
    """Layer ``i`` starts or ends the layered rows' span (the model's forward calls this there): the
    residual stream ``x`` takes its pending ``delta``, then gains their stream (start) or hands it
    over (end). Returns (x, no pending delta, the attention plan of the rows that run layer ``i``)."""
    if delta is not None:
        x.add_(delta)
    if i == layered.start:
        assert layered.hidden_in is not None  # LayeredHiddenStore.take gives one past layer 0
        return torch.cat([x, layered.hidden_in]), None, full_plan
    layered.hidden_out = x[num_rest:].clone()
    return x[:num_rest], None, layered.rest_plan


def without_last_request(inputs: AttentionInputs, num_rows: int) -> AttentionInputs:
    """``inputs`` without its last request (``num_rows`` tokens, the step's last)."""
    qsl = inputs.query_start_loc_np[:-1]
    seq_lens = inputs.seq_lens_np[:-1]
    num_reqs = inputs.num_reqs - 1
    max_seq = int(seq_lens.max()) if num_reqs else 0
    num_blocks = -(-max_seq // inputs.block_size)
    return AttentionInputs(
        num_tokens=inputs.num_tokens - num_rows,
        num_reqs=num_reqs,
        num_decodes=min(inputs.num_decodes, num_reqs),
        max_query_len=int(np.diff(qsl).max()) if num_reqs else 0,
        max_seq_len=max_seq,
        block_size=inputs.block_size,
        query_start_loc=inputs.query_start_loc[:-1],
        seq_lens=inputs.seq_lens[:-1],
        block_table=inputs.block_table[:-1, :num_blocks],
        slot_mapping=inputs.slot_mapping[: inputs.num_tokens - num_rows],
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        block_table_np=inputs.block_table_np[:-1, :num_blocks],
    )


class LayeredHiddenStore:
    """Residual streams of prompts between their layer-group steps, by request id."""

    def __init__(self) -> None:
        self._hidden: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._hidden)

    def drop_uncontinued(self, so: SchedulerOutput) -> None:
        """Drop the streams no group continues: a request that ended, restarted, or went on in token
        chunks (its climb stopped)."""
        new = {req.req_id for req in so.scheduled_new_reqs}
        ended = set(so.finished_req_ids) | set(so.preempted_req_ids)
        for req_id in [r for r in self._hidden if r in ended or r in new
                       or (r in so.num_scheduled_tokens and r not in so.layer_spans)]:
            del self._hidden[req_id]

    def take(self, rows: LayeredRows, step_id: int) -> torch.Tensor | None:
        """The stream a span starting past layer 0 continues (None for a first span)."""
        if rows.start == 0:
            self._hidden.pop(rows.req_id, None)
            return None
        hidden = self._hidden.pop(rows.req_id, None)
        if hidden is None or hidden.shape[0] != rows.num_rows:
            raise ValueError(f"step {step_id}: request {rows.req_id!r} continues its prefill at layer {rows.start} "
                             f"over {rows.num_rows} tokens, but this worker holds no such stream for it")
        return hidden

    def keep(self, req_id: str, hidden: torch.Tensor) -> None:
        self._hidden[req_id] = hidden
