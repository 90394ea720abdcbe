"""Structured output fields over HTTP (fake engine): what reaches the engine, and every 400."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

import pytest
from starlette.testclient import TestClient

from evenflow.frontend.api.server import ServerConfig, build_app, connect_context
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import StructuredOutputsParams

from .fakes import FakeEngineClient

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.fixture()
def fake(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(str(demo_model_dir), demo_tokenizer.encode("{}", add_special_tokens=False))


@pytest.fixture()
def http(fake: FakeEngineClient) -> Iterator[TestClient]:
    config = ServerConfig()
    with TestClient(build_app(config, lambda: connect_context(config, fake))) as c:
        yield c


def post(http: TestClient, path: str, **fields: object):  # noqa: ANN201
    body: dict = {"max_tokens": 2, **fields}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    return http.post(path, json=body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=CANONICAL)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=CANONICAL)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputsParams(grammar='start: "a"+')),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=CANONICAL)),
    ({"guided_regex": "[0-9]{3}"}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
    ({"response_format": {"type": "text"}}, None),
])
def test_each_form_reaches_the_engine_for_every_choice(http: TestClient, fake: FakeEngineClient, path: str,
                                                        fields: dict, expected: StructuredOutputsParams | None) -> None:
    r = post(http, path, n=2, **fields)
    assert r.status_code == 200, r.text
    assert [sub[2].structured_outputs for sub in fake.submitted] == [expected, expected]


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "Invalid type: objectx"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
    ({"guided_grammar": "start: missing"}, "guided_grammar", "unknown name"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "unsupported key(s) structural_tag"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "set only one"),
])
def test_bad_constraints_are_400_with_the_compilers_message(http: TestClient, fake: FakeEngineClient, fields: dict,
                                                            param: str, message: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(http, path, **fields)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"] and err["type"] == "BadRequestError"
    assert not fake.submitted


def test_without_llguidance_it_is_a_400_naming_the_extra(http: TestClient, fake: FakeEngineClient,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    r = post(http, "/v1/chat/completions", response_format={"type": "json_object"})
    assert r.status_code == 400
    assert "pip install 'evenflow[structured]'" in r.json()["error"]["message"] and not fake.submitted
    assert post(http, "/v1/chat/completions").status_code == 200  # free text still works
