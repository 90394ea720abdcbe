"""The engine's frontend codec against evenflow/protocol/README.md's rules: two-stage ``request`` decoding,
int64 bounds, errors in the wire's words, and the sampling ranges the README lists."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from evenflow.protocol import (
    INT64_MAX, INT64_MIN, AddRequest, Codec, DecodeError, FrontendToEngine, Hello, SamplingParams, UtilityCall,
)
from evenflow.protocol.codec import engine_codec
from evenflow.protocol.request_envelope import RequestRefused
from evenflow.protocol.validation import check_sampling_params

pack = msgspec.msgpack.encode


def refusal(frame: list) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        engine_codec().decode(pack(frame))
    return info.value


@pytest.mark.parametrize("params, field", [
    ({"max_tokens": 16.0}, "sampling_params.max_tokens: Expected `int`, got `float`"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos: Expected `bool`, got `int`"),
    ({"n": 2}, "sampling_params: unknown key `n`"),
    ({"temperature": "hot"}, "sampling_params.temperature: Expected `float`, got `str`"),
    ({"seed": 2**64 - 1}, "sampling_params.seed: Expected `int` <= 9223372036854775807 (integers on the wire are int64)"),
    ({"logprobs": 2**63}, "sampling_params.logprobs"),
])
def test_a_bad_sampling_param_is_refused_with_the_id_and_the_field(params: dict, field: str) -> None:
    refused = refusal(["request", "req-9", [1, 2], params])
    assert refused.request_id == "req-9" and str(refused).startswith(field), str(refused)


def test_a_request_whose_id_cannot_be_read_is_a_plain_decode_error() -> None:
    for frame in (["request", 5, [1]], ["request"], ["request", None, [1], {"n": 2}]):
        with pytest.raises(DecodeError) as info:
            engine_codec().decode(pack(frame))
        assert not isinstance(info.value, RequestRefused)


@settings(max_examples=150, deadline=None)
@given(frame=st.binary(max_size=128) | st.lists(st.one_of(st.just("request"), st.text(max_size=3),
                                                          st.integers(INT64_MIN, 2**64 - 1), st.floats(),
                                                          st.lists(st.integers(-3, 2**64 - 1), max_size=3),
                                                          st.dictionaries(st.sampled_from(["max_tokens", "seed", "n"]),
                                                                          st.integers(0, 2**64 - 1), max_size=2)),
                                                max_size=6).map(pack))
def test_the_two_stage_codec_decodes_like_the_one_stage_one_or_refuses(frame: bytes) -> None:
    """Same messages as a plain decoder of the union (bounded to int64); only the error kind differs."""
    try:
        plain = Codec(FrontendToEngine).decode(frame)
    except DecodeError:
        plain = None
    try:
        two_stage = engine_codec().decode(frame)
    except DecodeError as e:
        assert str(e)
        two_stage = None
    assert two_stage == plain


def test_every_int64_bound_is_accepted_and_one_past_is_refused() -> None:
    codec = engine_codec()
    req = codec.decode(pack(["request", "r", [INT64_MIN, INT64_MAX], {"seed": INT64_MAX}, INT64_MIN]))
    assert isinstance(req, AddRequest) and req.sampling_params.seed == INT64_MAX and req.priority == INT64_MIN
    assert codec.decode(pack(["utility", INT64_MAX, "get_stats"])) == UtilityCall(INT64_MAX, "get_stats")
    assert codec.decode(pack(["hello", INT64_MAX])) == Hello(INT64_MAX)
    for frame in (["utility", INT64_MAX + 1, "get_stats"], ["hello", INT64_MAX + 1]):
        with pytest.raises(DecodeError, match="int64"):
            codec.decode(pack(frame))
    assert "seed" in refusal(["request", "r", [1], {"seed": INT64_MAX + 1}]).args[0]


def test_seed_outside_int64_built_in_python_is_caught_by_the_validation() -> None:
    assert "seed" in str(check_sampling_params(SamplingParams(seed=2**64 - 1), 100))
    assert check_sampling_params(SamplingParams(seed=INT64_MIN), 100) is None


@pytest.mark.parametrize("frame, tag, span, got", [
    (["request", "r"], "request", "2 to 7", 1),
    (["request"], "request", "2 to 7", 0),
    (["request", "r", [1], {}, 0, 0.0, 0.0, "", 9], "request", "2 to 7", 8),
    (["hello"], "hello", "1 to 2", 0),
    (["hello", 1, "x", 3], "hello", "1 to 2", 3),
    (["utility", 1], "utility", "2 to 3", 1),
    (["abort", [], []], "abort", "1", 2),
])
def test_arity_errors_count_the_elements_after_the_tag_for_too_few_and_too_many(
        frame: list, tag: str, span: str, got: int) -> None:
    with pytest.raises(DecodeError) as info:
        engine_codec().decode(pack(frame))
    message = str(info.value)
    assert message.startswith(f"`{tag}` takes {span} fields after its tag (") and message.endswith(f", got {got}")


def test_errors_name_the_field_and_the_tag_not_positions() -> None:
    cases = {
        pack(["request", 5, [1]]): "`request` field request_id: Expected `str`, got `int`",
        pack(["abort", "x"]): "`abort` field request_ids: Expected `array`, got `str`",
        pack(["no_such_tag", 1]): "unknown tag 'no_such_tag' (this side receives: abort, heartbeat, hello, hold, request, utility)",
    }
    for frame, message in cases.items():
        with pytest.raises(DecodeError) as info:
            engine_codec().decode(frame)
        assert str(info.value) == message


@pytest.mark.parametrize("params, fragment", [
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(logprobs=-1), "logprobs"),
    (SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
    (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_the_readme_sampling_ranges_are_the_ones_enforced(params: SamplingParams, fragment: str) -> None:
    assert fragment in str(check_sampling_params(params, vocab_size=100))


def test_the_readme_sampling_range_edges_are_accepted() -> None:
    edges = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=20, stop_token_ids=[0, 99],
                           top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2, seed=INT64_MIN)
    assert check_sampling_params(edges, vocab_size=100) is None
    assert check_sampling_params(SamplingParams(logprobs=0), 100) is None
