"""The worker's batched sampler: one token per request from ``logits [num_reqs, vocab]``.

Pipeline (vLLM V1 order), all tensor ops over the batch:

1. logprobs, if asked, from the raw logits (see ``logprobs.py``);
2. penalties and ``min_tokens`` masking on the rows that need them (see ``penalties.py``);
3. greedy rows (``temperature < 1e-5``): argmax of the processed logits;
4. the other rows: divide by temperature, min-p, top-k, top-p, then an exponential race
   ``argmax(probs / Exponential(1))`` — the same law as sampling from ``probs``. Seeded requests
   draw their noise (``E = -log U``) from their own ``torch.Generator``, a fixed amount per token,
   so a seed reproduces its tokens whatever else shares the batch; unseeded rows draw together.

``SamplingMetadata.build`` runs every step; when every request is plain greedy (the common
case) it only scans the per-request flags computed once in ``RequestSamplingState.create``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from evenflow.protocol import SamplingParams, TokenLogprobs

from .logprobs import LogprobsMetadata, build_logprobs_metadata, compute_logprobs
from .penalties import (
    PenaltyMetadata,
    apply_min_tokens,
    apply_penalties,
    build_min_tokens_flat,
    build_penalty_metadata,
    has_penalties,
)

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
TOP_P_CANDIDATES = 256  # top-p looks for its nucleus among this many tokens before sorting all


@dataclass
class RequestSamplingState:
    """Sampling state of one request in the runner's persistent batch, created once per request.

    ``output_token_ids`` is the runner's live list; it must only grow by appending (a shorter
    list is detected and re-read, for rollbacks).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    # Derived once from params, so the per-step build only reads flags.
    is_greedy: bool = field(init=False)
    needs_penalties: bool = field(init=False)
    is_plain_greedy: bool = field(init=False)  # greedy, no penalties/min_tokens/logprobs
    _prompt_unique: np.ndarray | None = field(default=None, init=False, repr=False)
    _output_buffer: np.ndarray = field(init=False, repr=False)
    _output_len: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        self.is_greedy = p.temperature < SAMPLING_EPS
        self.needs_penalties = has_penalties(p)
        self.is_plain_greedy = (
            self.is_greedy and not self.needs_penalties and p.min_tokens == 0 and p.logprobs is None
        )
        self._output_buffer = np.zeros(0, dtype=np.int64)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        device: torch.device | str,
    ) -> RequestSamplingState:
        """A state with a generator seeded from ``params.seed`` on ``device`` (if a seed is set)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=torch.device(device)).manual_seed(params.seed)
        return cls(params, prompt_token_ids, output_token_ids, generator)

    def prompt_unique_ids(self, vocab_size: int) -> np.ndarray:
        """Distinct in-vocabulary prompt token ids (computed once; the prompt never changes)."""
        if self._prompt_unique is None:
            ids = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
            self._prompt_unique = ids[(ids >= 0) & (ids < vocab_size)]
        return self._prompt_unique

    def output_ids(self) -> np.ndarray:
        """The output tokens as int64, converting only what was appended since the last call."""
        out = self.output_token_ids
        n, done = len(out), self._output_len
        if n < done or (done and out[done - 1] != self._output_buffer[done - 1]):
            done = 0  # the list was rolled back: re-read it
        if n > self._output_buffer.size:
            grown = np.zeros(max(n, 2 * self._output_buffer.size, 64), dtype=np.int64)
            grown[:done] = self._output_buffer[:done]
            self._output_buffer = grown
        if n > done:
            self._output_buffer[done:n] = out[done:n]
        self._output_len = n
        return self._output_buffer[:n]


@dataclass
class RandomSamplingMetadata:
    """Parameters of the rows that sample randomly, on the device."""

    rows: torch.Tensor | None  # long [R]; None when every row samples randomly
    temperature: torch.Tensor  # float32 [R, 1]
    top_k: torch.Tensor | None  # long [R], 0 = disabled; None when no row uses top-k
    max_top_k: int  # largest enabled k (host int, so no device sync is needed)
    top_p: torch.Tensor | None  # float32 [R]; None when no row uses top-p
    min_p: torch.Tensor | None  # float32 [R]; None when no row uses min-p
    generators: list[tuple[int, torch.Generator]]  # (local row, generator) of seeded rows
    any_unseeded: bool


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, built from the batch's states."""

    num_reqs: int
    vocab_size: int
    random: RandomSamplingMetadata | None = None  # None: every row is greedy
    penalties: PenaltyMetadata | None = None
    min_tokens_flat: torch.Tensor | None = None  # flat row * vocab + stop-token ids to mask
    logprobs: LogprobsMetadata | None = None

    @classmethod
    def build(
        cls,
        states: list[RequestSamplingState],
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """Gather the step's sampling parameters; rows follow the order of ``states``."""
        meta = cls(num_reqs=len(states), vocab_size=vocab_size)
        if all(s.is_plain_greedy for s in states):
            return meta  # the hot path: plain argmax, nothing to move to the device
        random_rows: list[int] = []
        penalty_rows: list[int] = []
        min_tokens_rows: list[int] = []
        logprob_rows: list[int] = []
        for i, s in enumerate(states):
            if not s.is_greedy:
                random_rows.append(i)
            if s.needs_penalties:
                penalty_rows.append(i)
            if s.params.min_tokens and len(s.output_token_ids) < s.params.min_tokens:
                min_tokens_rows.append(i)
            if s.params.logprobs is not None:
                logprob_rows.append(i)
        if random_rows:
            meta.random = _build_random(states, random_rows, vocab_size, device)
        if penalty_rows:
            chosen = [states[i] for i in penalty_rows]
            meta.penalties = build_penalty_metadata(
                penalty_rows,
                [s.params for s in chosen],
                [s.prompt_unique_ids(vocab_size) for s in chosen],
                [s.output_ids() for s in chosen],
                vocab_size,
                device,
            )
        if min_tokens_rows:
            stop_ids = [_stop_ids(states[i].params, eos_token_ids) for i in min_tokens_rows]
            meta.min_tokens_flat = build_min_tokens_flat(
                min_tokens_rows, stop_ids, vocab_size, device
            )
        if logprob_rows:
            num_top = [states[i].params.logprobs or 0 for i in logprob_rows]
            meta.logprobs = build_logprobs_metadata(logprob_rows, num_top, len(states), device)
        return meta


def _stop_ids(params: SamplingParams, eos_token_ids: list[int]) -> list[int]:
    """Tokens that would stop the request: its stop ids, plus EOS unless ``ignore_eos``."""
    return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + eos_token_ids


def _build_random(
    states: list[RequestSamplingState], rows: list[int], vocab_size: int, device: torch.device
) -> RandomSamplingMetadata:
    params = [states[i].params for i in rows]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    # One host-to-device copy for all per-row floats: temperature, top_p, min_p.
    floats = torch.tensor(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        dtype=torch.float32,
    ).to(device, non_blocking=True)
    any_top_k = any(top_k)
    generators = [
        (j, states[i].generator) for j, i in enumerate(rows) if states[i].generator is not None
    ]
    return RandomSamplingMetadata(
        rows=None if len(rows) == len(states) else torch.tensor(rows, dtype=torch.long).to(device),
        temperature=floats[0].unsqueeze(1),
        top_k=torch.tensor(top_k, dtype=torch.long).to(device) if any_top_k else None,
        max_top_k=max(top_k),
        top_p=floats[1] if any(p.top_p < 1.0 for p in params) else None,
        min_p=floats[2] if any(p.min_p > 0.0 for p in params) else None,
        generators=generators,  # type: ignore[arg-type]  (filtered to non-None above)
        any_unseeded=len(generators) < len(rows),
    )


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
            sampled = x.argmax(dim=-1)
        elif r.rows is None:
            sampled = _sample_random(x if owned else x.clone(), r)
        else:
            sampled = x.argmax(dim=-1)
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
    return probs.div_(noise).argmax(dim=-1)
