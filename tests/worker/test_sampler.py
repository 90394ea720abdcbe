"""Tests of the batched sampler (evenflow/worker/sampler.py, sampling_metadata.py, penalties.py, logprobs.py), CPU
only."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.protocol import SamplingParams
from evenflow.worker import sampler as sampler_module
from evenflow.worker.sampler import Sampler, SamplerOutput, filter_logits
from evenflow.worker.sampling_metadata import RequestSamplingState, SamplingMetadata

CPU = torch.device("cpu")
EOS = 2


def make_state(
    prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> RequestSamplingState:
    return RequestSamplingState.create(
        SamplingParams(**params), prompt or [5, 6, 7], output if output is not None else [], CPU
    )


def sample(
    logits: torch.Tensor, states: list[RequestSamplingState], eos: list[int] | None = None
) -> SamplerOutput:
    meta = SamplingMetadata.build(states, logits.shape[-1], [EOS] if eos is None else eos, CPU)
    return Sampler()(logits, meta)


# ----------------------------------------------------------------------------- greedy


def test_plain_greedy_is_argmax_and_builds_nothing() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    states = [make_state(temperature=0.0) for _ in range(6)]
    meta = SamplingMetadata.build(states, 50, [EOS], CPU)
    assert meta.random is None and meta.penalties is None and meta.logprobs is None
    assert meta.min_tokens_flat is None
    out = Sampler()(logits, meta)
    assert out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.long
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_stay_argmax_and_input_is_untouched() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    before = logits.clone()
    states = [
        make_state(temperature=0.0),
        make_state(temperature=1.0, top_k=3),
        make_state(temperature=0.0, min_tokens=3, repetition_penalty=1.5),
        make_state(temperature=0.7, top_p=0.5, presence_penalty=1.0, output=[1, 1]),
        make_state(temperature=0.0, logprobs=1),
    ]
    out = sample(logits, states)
    assert torch.equal(logits, before)
    argmax = logits.argmax(-1)
    assert out.sampled_token_ids[0] == argmax[0]
    assert out.sampled_token_ids[4] == argmax[4]


def test_bfloat16_logits_and_padded_vocab() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 64).to(torch.bfloat16)
    logits[:, 60:] = 100.0  # padding columns beyond the vocabulary must never be picked
    states = [make_state(temperature=0.0), make_state(temperature=1.0), make_state(logprobs=3)]
    meta = SamplingMetadata.build(states, 60, [EOS], CPU)
    out = Sampler()(logits, meta)
    assert (out.sampled_token_ids < 60).all()
    assert out.sampled_token_ids[0] == logits[0, :60].float().argmax()


# ----------------------------------------------------------------------------- seeds


def _run_seeded(batch_of: list[tuple[str, dict]], steps: int, vocab: int = 100) -> dict:
    """Sample ``steps`` times; each named request gets logits from its own fixed stream."""
    states = {name: make_state(**params) for name, params in batch_of}
    streams = {name: torch.Generator().manual_seed(sum(map(ord, name))) for name, _ in batch_of}
    tokens: dict[str, list[int]] = {name: [] for name, _ in batch_of}
    for _ in range(steps):
        logits = torch.stack([torch.randn(vocab, generator=streams[n]) for n, _ in batch_of])
        torch.manual_seed(torch.randint(0, 2**31, ()).item())  # unseeded rows vary freely
        out = sample(logits, list(states.values()))
        for (name, _), tok in zip(batch_of, out.sampled_token_ids.tolist()):
            tokens[name].append(tok)
    return tokens


def test_seeded_requests_repeat_regardless_of_the_batch() -> None:
    seeded = {"seed": 1234, "temperature": 1.3, "top_p": 0.95}
    alone = _run_seeded([("a", seeded)], steps=12)
    crowded = _run_seeded(
        [
            ("x", {"temperature": 1.0}),
            ("y", {"temperature": 0.0}),
            ("a", seeded),
            ("z", {"seed": 7, "temperature": 0.5, "top_k": 4}),
        ],
        steps=12,
    )
    again = _run_seeded([("q", {"temperature": 2.0}), ("a", seeded)], steps=12)
    assert alone["a"] == crowded["a"] == again["a"]
    assert len(set(alone["a"])) > 3  # really random, not collapsed to greedy
    other_seed = _run_seeded([("a", {**seeded, "seed": 99})], steps=12)
    assert other_seed["a"] != alone["a"]


# ----------------------------------------------------------------------------- filters

filter_params = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.3, 1.0, 2.5]),
        "top_k": st.sampled_from([0, 1, 2, 5, 17]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5, 0.1, 1e-7]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    }
)


def _allowed(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, tol: float
) -> np.ndarray:
    """Reference kept set. ``tol > 0``: a superset lenient at rounding edges; ``< 0``: a subset."""
    x32 = logits.astype(np.float32) / np.float32(temperature)  # top-k ties exactly as float32
    x = x32.astype(np.float64)
    allowed = np.ones(x.shape, dtype=bool)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if min_p > 0:
        allowed &= probs >= min_p * probs.max() * (1 - tol)
    if 0 < top_k < x.size:
        allowed &= x32 >= np.sort(x32)[-top_k]
    if top_p < 1.0:
        kept = np.where(allowed, probs, 0.0)
        kept /= kept.sum()
        if tol > 0:  # ties may be kept: only the mass strictly above must stay below p
            above = np.array([kept[kept > p].sum() for p in kept])
        else:  # ties may be dropped: count them as above
            above = np.array([kept[kept >= p].sum() - p for p in kept])
        allowed &= above < top_p + tol
    return allowed


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(filter_params, min_size=1, max_size=4),
    vocab=st.integers(min_value=2, max_value=40),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    ties=st.booleans(),
    top_p_candidates=st.sampled_from([1, 3, 256]),  # nuclei found in the prefix, or by a sort
)
def test_filters_keep_exactly_the_allowed_set_and_sampling_stays_inside(
    params: list[dict], vocab: int, seed: int, scale: float, ties: bool, top_p_candidates: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=gen) * scale
    if ties:
        logits = logits.round()
    states = [make_state(seed=seed + i, **p) for i, p in enumerate(params)]
    meta = SamplingMetadata.build(states, vocab, [EOS], CPU)
    assert meta.random is not None
    with mock.patch.object(sampler_module, "TOP_P_CANDIDATES", top_p_candidates):
        kept = torch.isfinite(filter_logits(logits.clone(), meta.random)).numpy()
    for i, p in enumerate(params):
        lenient = _allowed(logits[i].numpy(), **p, tol=1e-4)
        strict = _allowed(logits[i].numpy(), **p, tol=-1e-4)
        assert (kept[i] <= lenient).all() and (strict <= kept[i]).all(), (p, logits[i], kept[i])
    for _ in range(5):
        out = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert all(kept[i][tok] for i, tok in enumerate(out))


# ----------------------------------------------------------------------------- distribution

# Upper 0.1% points of chi-square with dof = 1..15: a correct sampler fails one in 1000 seeds.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,
            31.26, 32.91, 34.53, 36.12, 37.70]  # fmt: skip


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum()), probs.size - 1


@pytest.mark.parametrize(
    "params, seeded, top_p_candidates",
    [
        ({"temperature": 0.7}, False, 256),
        ({"temperature": 1.5}, True, 256),
        ({"temperature": 1.0, "top_k": 4}, False, 256),
        ({"temperature": 0.8, "top_p": 0.75}, True, 2),  # nucleus of 3: found by a full sort
        ({"temperature": 0.8, "top_p": 0.75, "top_k": 6}, False, 4),  # found among the top 4
    ],
)
def test_empirical_frequencies_match_the_softmax(
    params: dict, seeded: bool, top_p_candidates: int
) -> None:
    torch.manual_seed(1000)
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = 20000
    states = [make_state(seed=i if seeded else None, **params) for i in range(rows)]
    with mock.patch.object(sampler_module, "TOP_P_CANDIDATES", top_p_candidates):
        out = sample(base.expand(rows, -1).clone(), states).sampled_token_ids
    counts = np.bincount(out.numpy(), minlength=base.numel()).astype(np.float64)
    probs = torch.softmax(base.double() / params["temperature"], -1).numpy()
    keep = np.ones_like(probs, dtype=bool)
    if "top_k" in params:
        keep[params["top_k"] :] = False  # base is sorted descending
    if "top_p" in params:  # on the distribution left by top-k
        renormalized = np.where(keep, probs, 0.0) / probs[keep].sum()
        mass_above = np.concatenate([[0.0], np.cumsum(renormalized)[:-1]])
        keep &= mass_above < params["top_p"]
    assert counts[~keep].sum() == 0
    target = np.where(keep, probs, 0.0)[keep]
    stat, dof = _chi_square(counts[keep], target / target.sum())
    assert stat < CHI2_999[dof - 1], (stat, counts, target)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30) * 3
    states = [
        make_state(temperature=0.0, logprobs=5, repetition_penalty=2.0, prompt=[1, 2, 3]),
        make_state(temperature=0.0),
        make_state(temperature=0.9, top_k=3, logprobs=0),
        make_state(temperature=1.0, logprobs=20, presence_penalty=2.0, output=[4, 4]),
    ]
    out = sample(logits, states)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs is not None and out.logprobs[1] is None
    sampled = out.sampled_token_ids.tolist()
    for row, n in [(0, 5), (2, 0), (3, 20)]:
        lp = out.logprobs[row]
        assert lp is not None
        assert len(lp.token_ids) == len(lp.logprobs) == n + 1
        assert lp.token_ids[0] == sampled[row]
        np.testing.assert_allclose(lp.logprobs, ref[row, lp.token_ids].numpy(), atol=1e-5)
        assert lp.token_ids[1:] == ref[row].topk(n).indices.tolist()
        rank = int((ref[row] > ref[row, sampled[row]]).sum()) + 1
        assert lp.sampled_rank == rank


# ----------------------------------------------------------------------------- penalties


def _reference_penalties(logits: torch.Tensor, s: RequestSamplingState) -> torch.Tensor:
    x = logits.double().clone()
    p = s.params
    for tok in set(s.prompt_token_ids) | set(s.output_token_ids):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(s.output_token_ids):
        count = s.output_token_ids.count(tok)
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([1.0, 0.5, 1.3, 2.0]),
            st.sampled_from([0.0, -1.5, 0.4, 2.0]),
            st.sampled_from([0.0, 1.0, -0.7]),
            st.lists(st.integers(0, 19), max_size=8),
            st.lists(st.integers(0, 19), max_size=12),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 1000),
)
def test_penalties_match_a_straightforward_reference(rows: list, seed: int) -> None:
    logits = torch.randn(len(rows), 20, generator=torch.Generator().manual_seed(seed)) * 2
    states = [
        make_state(
            prompt=prompt or [0],
            output=output,
            temperature=0.0,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        for rep, freq, pres, prompt, output in rows
    ]
    meta = SamplingMetadata.build(states, 20, [EOS], CPU)
    expected = torch.stack([_reference_penalties(logits[i], s) for i, s in enumerate(states)])
    if meta.penalties is not None:
        from evenflow.worker.penalties import apply_penalties

        got = logits.clone()
        apply_penalties(got, meta.penalties)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(logits.double(), expected)
    out = Sampler()(logits, meta).sampled_token_ids
    assert out.tolist() == expected.argmax(-1).tolist()


def test_penalties_follow_the_growing_output_list() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    output: list[int] = []
    state = make_state(output=output, temperature=0.0, frequency_penalty=0.6)
    picks = []
    for _ in range(4):
        tok = int(sample(logits, [state]).sampled_token_ids[0])
        picks.append(tok)
        output.append(tok)
    # Token 3 scores 1.0, then 0.4 (still the best), then -0.2: zeros win, 0 then 1.
    assert picks == [3, 3, 0, 1]
    del output[1:]  # a rollback must be noticed
    assert state.output_ids().tolist() == [3]


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 12)
    logits[:, EOS] = 10.0
    logits[:, 9] = 9.0
    logits[:, 4] = 8.0
    states = [
        make_state(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        make_state(temperature=0.0, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
        make_state(temperature=0.0, min_tokens=2, stop_token_ids=[9], output=[1, 1]),
    ]
    assert sample(logits, states).sampled_token_ids.tolist() == [4, EOS, EOS]
    random_states = [make_state(temperature=5.0, min_tokens=1, seed=i) for i in range(200)]
    out = sample(torch.zeros(200, 12), random_states, eos=[EOS, 11]).sampled_token_ids
    assert not ({EOS, 11} & set(out.tolist()))


# ----------------------------------------------------------------------------- cuda


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batch_with_every_feature_and_seed_independence() -> None:
    device = torch.device("cuda")
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=5)
    full = SamplingParams(
        temperature=1.1, repetition_penalty=1.2, presence_penalty=0.5, min_tokens=3, logprobs=3
    )

    def run(rows: list[tuple[SamplingParams, int]]) -> torch.Tensor:
        states = [RequestSamplingState.create(p, [1, 2, 3], [4, 4], device) for p, _ in rows]
        meta = SamplingMetadata.build(states, vocab, [EOS], device)
        out = Sampler()(logits[[i for _, i in rows]], meta)
        assert out.sampled_token_ids.device.type == "cuda"
        return out.sampled_token_ids.cpu()

    mixed = run([(SamplingParams(temperature=0.0), 0), (seeded, 1), (full, 2), (seeded, 3)])
    assert mixed[0] == logits[0].argmax().cpu()
    assert mixed[2] != EOS
    alone = run([(seeded, 1)])
    assert alone[0] == mixed[1]
