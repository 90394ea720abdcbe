"""Synthetic steps run before serving: the memory profile (the largest step) and the warm-up
(every shape class whose kernels would otherwise compile or initialize mid-serving).

A synthetic step is requests with given (new tokens, context length) over a block table of
consecutive blocks starting at block 0, token id 0 everywhere. Nothing here is reused by real
steps, which the persistent batch (batch.py) builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from evenflow.protocol import SamplingParams
from evenflow.worker.attention.base import AttentionInputs
from evenflow.worker.sampling_metadata import RequestSamplingState, SamplingMetadata

# The costliest sampling per row: every filter, penalties and 20 logprobs (a flat distribution
# also makes top-p sort the whole vocabulary).
HEAVIEST_SAMPLING = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.5, top_k=50, min_p=0.01,
                                   presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                   logprobs=20, seed=0)


@dataclass
class SyntheticStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionInputs
    logits_indices: torch.Tensor  # the last token of every request
    num_blocks: int  # blocks the block table spans (0 .. num_blocks-1)


def synthetic_step(q_lens: list[int], ctx_lens: list[int], block_size: int, device: torch.device) -> SyntheticStep:
    """A step of ``len(q_lens)`` requests; request i computes its last ``q_lens[i]`` of
    ``ctx_lens[i]`` positions. Requests with one new token must come first (decodes first)."""
    q = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(ctx_lens, dtype=np.int32)
    blocks_per_req = -(-int(ctx.max()) // block_size)
    num_reqs = len(q_lens)
    table = np.arange(num_reqs * blocks_per_req, dtype=np.int32).reshape(num_reqs, blocks_per_req)
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q)
    total = int(qsl[-1])
    req_of_token = np.repeat(np.arange(num_reqs), q)
    positions = (ctx[req_of_token] - q[req_of_token]) + (np.arange(total) - qsl[req_of_token])
    slots = table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    attn = AttentionInputs(
        num_tokens=total, num_reqs=num_reqs, num_decodes=int((q == 1).sum()), max_query_len=int(q.max()),
        max_seq_len=int(ctx.max()), block_size=block_size, query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(ctx).to(device), block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), query_start_loc_np=qsl, seq_lens_np=ctx,
        block_table_np=table,
    )
    return SyntheticStep(
        input_ids=torch.zeros(total, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        attn=attn,
        logits_indices=torch.from_numpy(qsl[1:].astype(np.int64) - 1).to(device),
        num_blocks=num_reqs * blocks_per_req,
    )


def heaviest_sampling(num_rows: int, vocab_size: int, eos_token_ids: list[int],
                      device: torch.device) -> SamplingMetadata:
    """Sampling metadata of ``num_rows`` requests that all take the costliest path."""
    states = [RequestSamplingState.create(HEAVIEST_SAMPLING, [0], [0], device) for _ in range(num_rows)]
    return SamplingMetadata.build(states, vocab_size, eos_token_ids, device)


def warmup_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int) -> list[tuple[list[int], list[int]]]:
    """(q_lens, ctx_lens) of the warm-up steps: a batch of decodes, and a chunk longer than 64
    tokens over a context of several blocks. Together they reach every variant the attention
    kernels compile (Triton's query tile is 16 rows up to 16 new tokens, 64 above)."""
    num_decodes = max(1, min(4, max_num_seqs))
    decode_ctx = min(max_model_len, 2 * block_size + 1)
    shapes = [([1] * num_decodes, [decode_ctx] * num_decodes)]
    chunk = min(max_num_batched_tokens, max_model_len, 65)
    if chunk > 1:
        shapes.append(([chunk], [min(max_model_len, chunk + 2 * block_size)]))
    return shapes
