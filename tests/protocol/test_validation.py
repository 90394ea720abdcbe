"""evenflow/protocol/validation.py: the one definition of each request rule, shared by frontend and engine-core."""

from __future__ import annotations

import math

import pytest

from evenflow.protocol import AddRequest, SamplingParams
from evenflow.protocol.validation import (
    INT64_MAX, INT64_MIN, check_add_request, check_context_length, check_prompt_token_ids, check_sampling_params,
)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(min_tokens=-1), "min_tokens"),
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=math.nan), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(min_p=1.5), "min_p"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(repetition_penalty=math.inf), "repetition_penalty"),
    (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(logprobs=-1), "logprobs"),
    (SamplingParams(seed=INT64_MAX + 1), "seed"),
    (SamplingParams(seed=INT64_MIN - 1), "seed"),
    (SamplingParams(stop_token_ids=[3, 300]), "stop_token_ids"),
])
def test_each_sampling_rule_names_its_field(params: SamplingParams, field: str) -> None:
    problem = check_sampling_params(params, vocab_size=256)
    assert problem is not None and problem.field == field and field in problem.message


def test_boundary_values_are_accepted() -> None:
    for params in (SamplingParams(), SamplingParams(temperature=0.0, logprobs=20, seed=INT64_MAX, min_tokens=16),
                   SamplingParams(seed=INT64_MIN, logprobs=0, top_k=-1, stop_token_ids=[0, 255])):
        assert check_sampling_params(params, vocab_size=256) is None


def test_prompt_ids_and_context_length() -> None:
    assert check_prompt_token_ids([0, 255], 256) is None
    empty = check_prompt_token_ids([], 256)
    assert empty is not None and "empty" in empty.message
    high = check_prompt_token_ids([1, 2, 256], 256)
    assert high is not None and "256 at position 2" in high.message
    low = check_prompt_token_ids([-5, 1], 256)
    assert low is not None and "-5 at position 0" in low.message
    assert check_context_length(90, 10, 100) is None
    over = check_context_length(90, 11, 100)
    assert over is not None and over.field == "max_tokens" and "requested 101 tokens" in over.message
    assert check_context_length(99, None, 100) is None
    full = check_context_length(100, None, 100)
    assert full is not None and full.field == "prompt" and "no room" in full.message


def test_add_request_checks_id_arrival_prompt_params_and_length() -> None:
    assert check_add_request(AddRequest("r", [1, 2]), 256, 100) is None
    cases = [(AddRequest("", [1]), "request_id"), (AddRequest("r", [1], arrival_time=math.nan), "arrival_time"),
             (AddRequest("r", [999]), "prompt"), (AddRequest("r", [1], SamplingParams(top_p=2.0)), "top_p"),
             (AddRequest("r", [1] * 95, SamplingParams(max_tokens=10)), "max_tokens")]
    for req, field in cases:
        problem = check_add_request(req, 256, 100)
        assert problem is not None and problem.field == field
