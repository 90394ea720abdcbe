"""Edge cases of the batched sampler (evenflow/worker/sampler.py) that the broad tests in test_sampler.py
do not reach: the caller's tensor, memory layouts, exact top-p ties, and which rows pay for a
full sort. CPU only."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from evenflow.protocol import SamplingParams
from evenflow.worker import sampler as sampler_module
from evenflow.worker.sampler import Sampler, filter_logits
from evenflow.worker.sampling_metadata import RequestSamplingState, SamplingMetadata

CPU = torch.device("cpu")
EOS = 2
# Their softmax is exactly [0.5, 0.25, 0.125, 0.125] in float32, so top-p's sums are exact.
DYADIC = [math.log(p) for p in (0.5, 0.25, 0.125, 0.125)]


def make_states(*params: dict) -> list[RequestSamplingState]:
    return [
        RequestSamplingState.create(SamplingParams(**p), [5, 6, 7], [], CPU) for p in params
    ]


def build(states: list[RequestSamplingState], vocab: int) -> SamplingMetadata:
    return SamplingMetadata.build(states, vocab, [EOS], CPU)


def test_an_all_random_float32_batch_leaves_the_callers_logits_untouched() -> None:
    # Every row random and no penalties: the sampler works on raw.float(), which for float32
    # logits is the caller's own storage, so it must copy before filtering in place.
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    states = make_states(
        {"temperature": 0.8, "top_k": 3, "seed": 1},
        {"temperature": 1.0, "top_p": 0.5, "seed": 2},
        {"temperature": 2.0, "min_p": 0.2, "seed": 3},
    )
    meta = build(states, 30)
    assert meta.random is not None and meta.random.rows is None and meta.penalties is None
    out = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(logits, before)
    assert out.shape == (3,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_work_on_column_major_logits_of_any_dtype(dtype: torch.dtype) -> None:
    # Penalties scatter through a flat view, which needs a contiguous tensor; a column-major
    # input (dense but transposed) must be copied to row-major first, whether or not .float()
    # already made a copy.
    base = torch.randn(4, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    column_major = base.T.contiguous().T
    assert not column_major.is_contiguous() and torch.equal(column_major, base)
    before = column_major.clone()
    params = [
        {"temperature": 0.0, "repetition_penalty": 3.0},
        {"temperature": 0.0, "presence_penalty": 5.0},
        {"temperature": 0.0, "min_tokens": 2},
        {"temperature": 0.0},
    ]
    states = make_states(*params)
    for state in states[:2]:
        state.output_token_ids.extend(base[0:2].float().argmax(-1).tolist())
    meta = build(states, 40)
    got = Sampler()(column_major, meta).sampled_token_ids
    want = Sampler()(base.contiguous(), meta).sampled_token_ids
    assert got.tolist() == want.tolist()
    assert torch.equal(column_major, before)


def test_top_p_keeps_the_fewest_tokens_whose_mass_reaches_p_exactly() -> None:
    # With probabilities [0.5, 0.25, 0.125, 0.125], p = 0.5 is reached by the first token alone
    # and p = 0.75 by the first two: a token whose preceding mass equals p is dropped.
    logits = torch.tensor([DYADIC] * 3)
    states = make_states(
        {"temperature": 1.0, "top_p": 0.5},
        {"temperature": 1.0, "top_p": 0.75},
        {"temperature": 1.0, "top_p": 0.76},
    )
    meta = build(states, 4)
    assert meta.random is not None
    kept = torch.isfinite(filter_logits(logits.clone(), meta.random)).tolist()
    assert kept == [[True, False, False, False], [True, True, False, False], [True] * 4]
    for _ in range(20):  # sampling stays inside: row 0 can only be token 0
        assert Sampler()(logits, meta).sampled_token_ids[0] == 0


def test_top_p_sorts_in_full_only_the_rows_whose_nucleus_is_wider_than_the_candidates() -> None:
    # With the top 2 of 4 tokens as candidates (mass 0.75): p = 0.75 and p = 0.5 are found
    # among them; p = 1.0 disables top-p; only p = 0.9 needs the slow full sort (a sort of the
    # vocabulary costs ~20x a top-256 on CPU).
    logits = torch.tensor([DYADIC] * 4)
    states = make_states(
        {"temperature": 1.0, "top_p": 0.75},
        {"temperature": 1.0, "top_p": 1.0},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 1.0, "top_p": 0.5},
    )
    meta = build(states, 4)
    assert meta.random is not None
    ranked_shapes: list[tuple[int, ...]] = []
    real = sampler_module._nucleus_threshold

    def spy(ranked: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ranked_shapes.append(tuple(ranked.shape))
        return real(ranked, top_p)

    with (
        mock.patch.object(sampler_module, "TOP_P_CANDIDATES", 2),
        mock.patch.object(sampler_module, "_nucleus_threshold", spy),
    ):
        kept = torch.isfinite(filter_logits(logits.clone(), meta.random)).tolist()
    assert ranked_shapes == [(4, 2), (1, 4)]  # the candidates of all rows, then row 2 sorted
    assert kept == [[True, True, False, False], [True] * 4, [True] * 4, [True, False, False, False]]
