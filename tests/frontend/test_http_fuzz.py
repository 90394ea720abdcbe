"""Hypothesis fuzz of HTTP request parsing: any body gets 200 or a 4xx with OpenAI's error JSON,
never a 500 or a hang. Bounded for the suite; EVENFLOW_FUZZ_EXAMPLES=N runs longer by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from starlette.testclient import TestClient

from evenflow.frontend.api.server import ServerConfig, build_app, connect_context

from .fakes import FakeEngineClient

EXAMPLES = int(os.environ.get("EVENFLOW_FUZZ_EXAMPLES", "60"))
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "temperature",
          "top_p", "top_k", "stop", "logprobs", "top_logprobs", "echo", "seed", "presence_penalty",
          "frequency_penalty", "stream_options", "priority", "return_token_ids", "ignore_eos", "min_tokens",
          "response_format", "tools", "add_special_tokens", "tokens", "role", "content", "bogus"]
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                  st.text(max_size=12), st.sampled_from(["demo", "user", "assistant", "system", "hi there"]))
_json = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)), max_leaves=16)
_objects = st.dictionaries(st.sampled_from(FIELDS), _json, max_size=8)
BODIES = st.one_of(
    _objects.map(lambda d: json.dumps(d).encode()),
    # Mostly valid requests with one field fuzzed: reach past the first type check.
    st.tuples(st.sampled_from(FIELDS), _json).map(
        lambda kv: json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                               kv[0]: kv[1]}).encode()),
    st.binary(max_size=64),
)


@pytest.fixture(scope="module")
def http(demo_model_dir: Path) -> Iterator[TestClient]:
    fake = FakeEngineClient(str(demo_model_dir), [5, 6, 7])
    config = ServerConfig(max_body_bytes=4096)
    with TestClient(build_app(config, lambda: connect_context(config, fake))) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_any_body_gets_a_clean_answer(http: TestClient, path: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=BODIES)
    def check(body: bytes) -> None:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404, 413), (r.status_code, body, r.text)
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] == r.status_code and err["message"] and err["type"]
            if r.status_code == 404:  # only a model name that is not served
                assert err["param"] == "model" and json.loads(body)["model"], err

    check()
