"""Speculative decoding in the worker: verify drafts after the forward, propose the next ones.

Verification couples the draft with the target sample. Every position of a request (its drafts'
and its last known token's) is sampled exactly as without speculation, with the same per-token
noise; a draft is accepted while it equals the token sampled at its position, and the first
sampled token that differs is emitted in its place (a bonus token when all are accepted). With a
one-hot draft this *is* the rule "accept draft x with probability p(x), else sample from p with x
removed and renormalized": P(sample = x) = p(x), and a sample that is not x is distributed as p
restricted to the other tokens. Greedy is the special case p = one-hot(argmax). So speculation
changes no token's distribution, and a seeded request produces the very same tokens with it on or
off: its generator is rewound past the positions whose samples were discarded.

Drafts come from the n-gram proposer (ngram_proposer.py) run here, where the tokens are, right
after each sample, and are written into the request's row after its known tokens. The engine-core
only reserves slots; with overlap it does so before this step's tokens, and drafts, exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from evenflow.protocol import SpeculativeConfig

from evenflow.worker.batch import PersistentBatch, RequestState
from evenflow.worker.ngram_proposer import propose_ngram


@dataclass
class GeneratorRewind:
    """Seeded requests with drafts: their generator state before the step, to replay it later."""

    entries: list[tuple[int, torch.Generator, torch.Tensor]]  # (request index, generator, state)

    @classmethod
    def save(cls, reqs: list[RequestState], num_drafts: np.ndarray) -> GeneratorRewind:
        return cls([(i, s.sampling.generator, s.sampling.generator.get_state())
                    for i, s in enumerate(reqs)
                    if num_drafts[i] > 0 and s.sampling.generator is not None and not s.sampling.is_greedy])

    def replay(self, num_emitted: np.ndarray, vocab_size: int, device: torch.device) -> None:
        """Leave each generator as if only the emitted tokens had drawn their noise."""
        for i, generator, state in self.entries:
            generator.set_state(state)
            row = torch.empty(vocab_size, device=device)
            for _ in range(int(num_emitted[i])):  # one noise row per emitted token, as the sampler draws
                row.uniform_(generator=generator)


def accept_drafts(targets: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Tokens emitted per request: 1 + the drafts accepted before the first mismatch.

    ``targets`` holds each request's ``num_drafts[i] + 1`` sampled tokens, consecutive;
    ``drafts [R, >= max(num_drafts)]`` the drafts, left-aligned.
    """
    width = int(num_drafts.max(initial=0))
    if width == 0:
        return np.ones(len(num_drafts), dtype=np.int64)
    starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    positions = np.arange(width)
    in_draft = positions < num_drafts[:, None]
    sampled = targets[np.where(in_draft, starts[:, None] + positions, 0)]
    matches = (sampled == drafts[:, :width]) & in_draft
    return np.cumprod(matches, axis=1).sum(axis=1) + 1


def emitted_rows(num_drafts: np.ndarray, num_emitted: np.ndarray) -> np.ndarray:
    """Indices, in the step's sampled rows, of the tokens that are emitted (each request's first
    ``num_emitted`` rows)."""
    starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    emitted_starts = np.cumsum(num_emitted) - num_emitted
    return np.repeat(starts, num_emitted) + np.arange(int(num_emitted.sum())) - np.repeat(emitted_starts, num_emitted)


class NgramDrafter:
    """Proposes each sampled request's drafts and stores them in its batch row."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def draft_limits(self, reqs: list[RequestState]) -> np.ndarray:
        """K, capped so that the next step cannot pass max_model_len or max_tokens.

        Requests with penalties or a pending ``min_tokens`` do not draft: their logits processing
        depends on every earlier output token, which drafts would have to be threaded through.
        """
        k = self.config.num_speculative_tokens
        limits = np.empty(len(reqs), dtype=np.int64)
        for i, s in enumerate(reqs):
            params = s.sampling.params
            if (s.sampling.needs_penalties or len(s.output_token_ids) < params.min_tokens
                    or params.structured_outputs is not None):  # the engine gives a grammar no slots
                limits[i] = 0
                continue
            room = min(self.max_model_len - s.num_tokens, params.max_tokens - len(s.output_token_ids)) - 1
            limits[i] = min(k, room)
        return limits

    def propose(self, batch: PersistentBatch, reqs: list[RequestState]) -> np.ndarray:
        """Propose for ``reqs``, write the drafts after their tokens; return the counts."""
        if not reqs:
            return np.zeros(0, dtype=np.int64)
        threshold = self.config.disable_by_batch_size
        if threshold is not None and len(reqs) >= threshold:
            # The engine-core gives no slots at this load (its rule counts running requests);
            # any it does give are simply left empty. Stale drafts are dropped.
            for state in reqs:
                state.num_drafts = 0
            return np.zeros(len(reqs), dtype=np.int64)
        rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=len(reqs))
        lengths = np.fromiter((s.num_tokens for s in reqs), dtype=np.int64, count=len(reqs))
        limits = self.draft_limits(reqs)
        table = batch.token_ids[rows, : int(lengths.max())]
        drafts, counts = propose_ngram(table, lengths, limits, self.config.ngram_min, self.config.ngram_max)
        if drafts.shape[1]:
            cols = lengths[:, None] + np.arange(drafts.shape[1])
            keep = np.arange(drafts.shape[1]) < counts[:, None]
            batch.token_ids[np.broadcast_to(rows[:, None], cols.shape)[keep], cols[keep]] = drafts[keep]
        for state, count in zip(reqs, counts.tolist()):
            state.num_drafts = count
        return counts

    @staticmethod
    def stored_drafts(batch: PersistentBatch, reqs: list[RequestState], num_drafts: np.ndarray) -> np.ndarray:
        """The drafts being verified this step, ``[R, max(num_drafts)]``, from the batch rows."""
        width = int(num_drafts.max(initial=0))
        rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((s.num_tokens for s in reqs), dtype=np.int64, count=len(reqs))
        cols = np.minimum(starts[:, None] + np.arange(width), batch.max_tokens - 1)
        return batch.token_ids[rows[:, None], cols]
