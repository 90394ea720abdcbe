"""What the sampler needs each step, gathered from the persistent batch's request states.

``RequestSamplingState`` is created once per request and derives its flags then, so
``SamplingMetadata.build`` (every step) only scans flags when every request is plain greedy (the
common case) and moves nothing to the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from evenflow.protocol import SamplingParams

from evenflow.worker.logprobs import LogprobsMetadata, build_logprobs_metadata
from evenflow.worker.penalties import PenaltyMetadata, build_min_tokens_flat, build_penalty_metadata, has_penalties

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)


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


def all_plain_greedy(states: Iterable[RequestSamplingState]) -> bool:
    """Whether every request takes the plain argmax: no sampling, penalties, min_tokens or logprobs
    (the sampler then builds nothing, and the LM head may leave all but each row's argmax rough)."""
    return all(s.is_plain_greedy for s in states)


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
        if all_plain_greedy(states):
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
