"""The worker's batched sampler: one token per request from ``logits [num_reqs, vocab]``.

Pipeline (vLLM V1 order), all tensor ops over the batch:

1. logprobs, if asked, from the raw logits (see ``logprobs.py``);
2. penalties and ``min_tokens`` masking on the rows that need them (see ``penalties.py``);
3. greedy rows (``temperature < 1e-5``): argmax of the processed logits (``argmax.py``: torch's answer in C++);
4. the other rows: divide by temperature, min-p, top-k, top-p, then an exponential race
   ``argmax(probs / Exponential(1))`` — the same law as sampling from ``probs``. Seeded requests
   draw their noise (``E = -log U``) from their own ``torch.Generator``, a fixed amount per token,
   so a seed reproduces its tokens whatever else shares the batch; unseeded rows draw together.

What each step samples with is gathered by ``SamplingMetadata.build`` (sampling_metadata.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evenflow.protocol import TokenLogprobs

from evenflow.worker.argmax import row_argmax
from evenflow.worker.logprobs import compute_logprobs
from evenflow.worker.penalties import apply_min_tokens, apply_penalties
from evenflow.worker.sampling_metadata import RandomSamplingMetadata, SamplingMetadata

TOP_P_CANDIDATES = 256  # top-p looks for its nucleus among this many tokens before sorting all


@dataclass
class SamplerOutput:
    """One sampled token per request, and logprobs for the requests that asked."""

    sampled_token_ids: torch.Tensor  # long [num_reqs], on the logits' device
    logprobs: list[TokenLogprobs | None] | None  # None when no request asked


class Sampler:
    """Samples one token per row of ``logits`` as ``SamplingMetadata`` says. Stateless."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits [num_reqs, >= vocab]`` (any float dtype; computed in float32).

        The caller's tensor is never modified.
        """
        raw = logits[:, : metadata.vocab_size]
        x = raw.float()
        owned = raw.dtype != torch.float32  # .float() made a fresh tensor we may modify in place
        if metadata.penalties is not None or metadata.min_tokens_flat is not None:
            if not owned or not x.is_contiguous():
                x = x.clone(memory_format=torch.contiguous_format)
                owned = True
            if metadata.penalties is not None:
                apply_penalties(x, metadata.penalties)
            if metadata.min_tokens_flat is not None:
                apply_min_tokens(x, metadata.min_tokens_flat)
        r = metadata.random
        if r is None:
            sampled = row_argmax(x)
        elif r.rows is None:
            sampled = _sample_random(x if owned else x.clone(), r)
        else:
            sampled = row_argmax(x)
            sampled.index_copy_(0, r.rows, _sample_random(x.index_select(0, r.rows), r))
        logprobs = None
        if metadata.logprobs is not None:
            logprobs = compute_logprobs(raw, sampled, metadata.logprobs, metadata.num_reqs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _sample_random(logits: torch.Tensor, r: RandomSamplingMetadata) -> torch.Tensor:
    """Sample rows of ``logits`` (owned, modified in place) after temperature and filters."""
    probs = filter_logits(logits, r).softmax(dim=-1)
    return _exponential_race(probs, r)


def filter_logits(logits: torch.Tensor, r: RandomSamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p (vLLM's order) on the random rows, in place.

    Returns the filtered logits (the same storage): excluded tokens are ``-inf``. Tokens tied
    with the last one kept by top-k or top-p are kept too.
    """
    logits.div_(r.temperature)
    if r.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * r.min_p.unsqueeze(1)
        logits.masked_fill_(probs < threshold, float("-inf"))
    if r.top_k is not None:
        _top_k(logits, r.top_k, r.max_top_k)
    if r.top_p is not None:
        _top_p(logits, r.top_p)
    return logits


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep tokens at or above each row's k-th largest logit (k = 0: keep all). In place."""
    top_values = logits.topk(max_top_k, dim=-1).values  # sorted descending, [R, max_k]
    kth = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    kth.masked_fill_((top_k == 0).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Nucleus filter in place: keep the fewest most likely tokens whose mass reaches ``p``.

    A full sort of the vocabulary is slow (20x a top-256 on CPU), and most nuclei are small: the
    threshold comes from the top ``TOP_P_CANDIDATES`` probabilities, and only rows whose nucleus
    is wider than that (flat distributions) are sorted in full. That check costs a device sync.
    """
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[-1]
    candidates = min(TOP_P_CANDIDATES, vocab)
    threshold, covered = _nucleus_threshold(probs.topk(candidates, dim=-1).values, top_p)
    disabled = top_p >= 1.0
    if candidates < vocab:
        wide = ~(covered | disabled)
        if bool(wide.any()):
            rows = wide.nonzero().squeeze(1)
            ranked = probs.index_select(0, rows).sort(dim=-1, descending=True).values
            threshold.index_copy_(0, rows, _nucleus_threshold(ranked, top_p[rows])[0])
    threshold.masked_fill_(disabled.unsqueeze(1), 0.0)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _nucleus_threshold(
    ranked: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """From probabilities sorted descending (a prefix of the vocabulary's, or all of it): the
    smallest kept probability per row ``[R, 1]``, and whether the prefix held the whole nucleus.

    A token is kept when the mass strictly before it is below ``p``; the first always is.
    """
    cumulative = ranked.cumsum(dim=-1)
    num_kept = ((cumulative - ranked) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
    return ranked.gather(1, num_kept.clamp(min=1) - 1), cumulative[:, -1] >= top_p


def _exponential_race(probs: torch.Tensor, r: RandomSamplingMetadata) -> torch.Tensor:
    """``argmax(probs / E)`` with ``E ~ Exponential(1)`` per token: a draw from ``probs``.

    ``E = -log(U)`` with ``U`` uniform in [0, 1): ``Tensor.exponential_`` is ~5x slower on CPU
    and may return exactly 0 (0 / 0 is NaN, which argmax would pick). Seeded rows draw their
    own ``U`` row, so their tokens do not depend on the rest of the batch.
    """
    noise = torch.empty_like(probs)
    if r.any_unseeded:
        noise.uniform_()
    for row, generator in r.generators:
        noise[row].uniform_(generator=generator)
    noise.log_().neg_()  # in (0, inf]
    return row_argmax(probs.div_(noise))
