"""Structured output end to end: engine-core + frontend processes, the random-weight demo model.

Random weights write no sensible JSON by themselves, so every output here is the grammar's doing:
each one that ends with ``stop`` must parse and validate (jsonschema) or match (regex, choice),
and each one cut by ``length`` must be a prefix the grammar accepts (its tokens all consumed by a
fresh llguidance matcher). A schema that compiles for seconds (the engine's test hook) and many
distinct schemas at once must leave the other streams' inter-token latency flat.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from evenflow.core.sched.structured_output import COMPILE_DELAY_ENV, COMPILE_DELAY_MARKER
from evenflow.protocol.hf_config import read_hf_config
from evenflow.protocol.structured_outputs import to_grammar

from .live import start, stop, wait_for
from tests.ports import free_port

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

SLOW_COMPILE_S = 4.0
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "n", "color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
]
REGEX = r"(yes|no)-[0-9]{2,3}"
CHOICES = ["alpha", "beta", "gamma delta"]


@dataclass
class Live:
    url: str  # the frontend's HTTP address
    engine: str  # the engine-core's address, for raw wire clients


@pytest.fixture(scope="module")
def live(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("structured")
    engine_addr = f"ipc://{tmp}/engine.sock"
    port = free_port()
    logs = [tmp / "engine.log", tmp / "frontend.log"]
    env = {COMPILE_DELAY_ENV: str(SLOW_COMPILE_S)}
    procs = [start(["-m", "evenflow.core.cli", "--model", str(demo_model_dir), "--listen", engine_addr,
                    "--served-model-name", "demo", "--max-model-len", "512", "--num-kv-blocks", "128",
                    "--max-num-batched-tokens", "256"], logs[0], env)]
    procs.append(start(["-m", "evenflow.frontend.cli", "--engine", engine_addr, "--port", str(port)], logs[1], env))
    try:
        wait_for(lambda: "serving demo" in logs[1].read_text(errors="replace"), 120, procs, logs)
        yield Live(f"http://127.0.0.1:{port}", engine_addr)
    finally:
        stop(procs[1:])
        stop(procs[:1])


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    """llguidance's view of the demo tokenizer with the model's EOS ids (</s> and <|im_end|>)."""
    return llguidance.LLTokenizer((demo_model_dir / "tokenizer.json").read_text(),
                                  eos_token=read_hf_config(demo_model_dir).eos_token_ids)


def complete(url: str, **body: Any) -> list[dict[str, Any]]:
    body = {"model": "demo", "prompt": "The answer:", "return_token_ids": True, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def accepted_prefix(tokenizer: Any, kind: str, spec: str, token_ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, to_grammar(kind, spec))
    ids = [t for t in token_ids if t not in tokenizer.eos_tokens]
    return matcher.validate_tokens(ids) == len(ids) and not matcher.is_error()


def check(choices: list[dict[str, Any]], tokenizer: Any, kind: str, spec: str, valid: Any) -> list[str]:
    """Each stopped output is valid; each cut output is a prefix the grammar accepts."""
    for choice in choices:
        assert choice["finish_reason"] in ("stop", "length"), choice
        if choice["finish_reason"] == "stop":
            assert valid(choice["text"]), choice["text"]
        assert accepted_prefix(tokenizer, kind, spec, choice["token_ids"]), choice["text"]
    return [c["finish_reason"] for c in choices]


def test_json_schema_outputs_validate_or_are_accepted_prefixes(live: Live, tokenizer: Any) -> None:
    reasons = []
    for i, schema in enumerate(SCHEMAS):
        spec = json.dumps(schema, separators=(",", ":"))
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        for temperature in (0.0, 1.0):
            choices = complete(live.url, response_format=rf, max_tokens=40, n=3, seed=i, temperature=temperature)

            def valid(text: str, schema: dict = schema) -> bool:
                jsonschema.validate(json.loads(text), schema)
                return True

            reasons += check(choices, tokenizer, "json", spec, valid)
    assert "stop" in reasons  # the validity check above was not vacuous


def test_regex_choice_and_json_object_outputs(live: Live, tokenizer: Any) -> None:
    choices = complete(live.url, structured_outputs={"regex": REGEX}, max_tokens=12, n=4, seed=1)
    assert "stop" in check(choices, tokenizer, "regex", REGEX, lambda t: re.fullmatch(REGEX, t))
    choices = complete(live.url, guided_choice=CHOICES, max_tokens=12, n=4, seed=2)
    assert set(check(choices, tokenizer, "choice", json.dumps(CHOICES), lambda t: t in CHOICES)) == {"stop"}
    choices = complete(live.url, guided_regex=REGEX, max_tokens=3, n=2, seed=3)  # too short: cut prefixes
    assert set(check(choices, tokenizer, "regex", REGEX, lambda t: False)) == {"length"}
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
        "model": "demo", "messages": [{"role": "user", "content": "json please"}], "max_tokens": 30,
        "response_format": {"type": "json_object"}, "seed": 4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_invalid_schema_is_a_400_with_the_compilers_message(live: Live) -> None:
    r = httpx.post(live.url + "/v1/completions", timeout=30, json={
        "model": "demo", "prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"pattern": "(("}}}})
    assert r.status_code == 400 and "unclosed group" in r.json()["error"]["message"]


def _stream_times(url: str, max_tokens: int, out: list[float], started: threading.Event) -> None:
    body = {"model": "demo", "prompt": "def f():", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.monotonic())
                started.set()


def _max_gap(times: list[float], start: float, end: float) -> float:
    """The longest wait for the stream's next event within [start, end], counted only while the stream
    was live: a stream that ended early (or a window with fewer than two events) is not a blocked one."""
    start, end = max(start, times[0]), min(end, times[-1])
    if end <= start:
        return 0.0
    points = [start, *(t for t in times if start < t < end), end]
    return max(b - a for a, b in zip(points, points[1:]))


def test_slow_compile_and_many_schemas_leave_other_streams_flowing(live: Live, tokenizer: Any) -> None:
    times: list[list[float]] = [[], []]
    started = [threading.Event(), threading.Event()]
    streams = [threading.Thread(target=_stream_times, args=(live.url, 440, times[i], started[i])) for i in (0, 1)]
    for t in streams:
        t.start()
    for e in started:
        assert e.wait(60)
    deadline = time.monotonic() + 60
    while min(len(t) for t in times) < 20 and time.monotonic() < deadline:  # a baseline to compare with
        time.sleep(0.05)
    slow_schema = {"description": COMPILE_DELAY_MARKER, "enum": ["slow", "compile"]}
    many = [{"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": i + 9}},
             "required": [f"k{i}"], "additionalProperties": False} for i in range(12)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(13) as pool:
        slow = pool.submit(complete, live.url, guided_json=slow_schema, max_tokens=8, temperature=0.0)
        fast = [pool.submit(complete, live.url, guided_json=s, max_tokens=16, temperature=0.0) for s in many]
        fast_done = [f.result() for f in fast]
        t_fast = time.monotonic()
        slow_choice = slow.result()[0]
    t_slow = time.monotonic()
    for t in streams:
        t.join()
    # The slow grammar waited ~SLOW_COMPILE_S in WAITING_FOR_FSM; the other schemas did not wait for it.
    assert t_slow - t0 >= SLOW_COMPILE_S and t_fast - t0 < t_slow - t0
    assert slow_choice["finish_reason"] == "stop" and json.loads(slow_choice["text"]) in ("slow", "compile")
    for schema, choices in zip(many, fast_done):
        check(choices, tokenizer, "json", json.dumps(schema, separators=(",", ":")),
              lambda text, s=schema: jsonschema.validate(json.loads(text), s) is None)
    # While only the slow grammar was compiling, the plain streams kept their pace; while the 12
    # others compiled (2 threads; llguidance holds the GIL for part of each), they slowed but
    # never stopped. A loop blocked by a compile would show a gap of SLOW_COMPILE_S.
    for stream in times:
        baseline = _max_gap(stream, stream[0], t0)
        burst = _max_gap(stream, t0, t_fast)
        slow_only = _max_gap(stream, t_fast, t_slow - 0.5)
        print(f"plain stream: largest gap {baseline:.3f} s before, {burst:.3f} s while 12 schemas compiled, "
              f"{slow_only:.3f} s while only the slow one did")
        assert slow_only < max(0.5, 3 * baseline), (baseline, slow_only)
        assert burst < SLOW_COMPILE_S / 2, (baseline, burst)
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    assert "evenflow:grammar_compile_seconds_bucket" in metrics and "evenflow:grammar_cache_hits_total" in metrics


def test_offline_llm_takes_a_schema_object_and_refuses_a_bad_one(demo_model_dir: Path) -> None:
    from evenflow.frontend import LLM, SamplingParams, StructuredOutputsParams

    schema = {"enum": ["on", "off", "auto"]}
    with LLM(model=str(demo_model_dir), max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=64,
             max_num_seqs=8) as llm:
        params = SamplingParams(max_tokens=10, n=3, seed=0, structured_outputs=StructuredOutputsParams(json=schema))  # type: ignore[arg-type]
        outs = llm.generate("state:", params)[0].outputs
        assert len(outs) == 3 and all(o.finish_reason == "stop" and json.loads(o.text) in schema["enum"] for o in outs)
        with pytest.raises(ValueError, match="unclosed group"):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))


def test_wire_client_gets_the_compilers_message_while_others_are_served(live: Live) -> None:
    import zmq

    from evenflow.protocol import (PROTOCOL_VERSION, AddRequest, Codec, EngineToFrontend, Error, Hello, Outputs,
                                   SamplingParams, StructuredOutputsParams)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(live.engine)
    codec: Codec[EngineToFrontend] = Codec(EngineToFrontend)
    try:
        sock.send(codec.encode(Hello(PROTOCOL_VERSION, "raw")))
        assert sock.poll(10000) and not isinstance(codec.decode(sock.recv()), Error)
        bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="x(y"))
        sock.send(codec.encode(AddRequest("bad", [5, 6], bad)))
        sock.send(codec.encode(AddRequest("ok", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True))))
        errors, finished = [], None
        while finished is None or not errors:  # both arrive, in either order
            assert sock.poll(20000)
            msg = codec.decode(sock.recv())
            if isinstance(msg, Error):
                errors.append(msg)
            elif isinstance(msg, Outputs):
                for out in msg.outputs:
                    assert out.request_id == "ok"
                    finished = out.finish_reason or finished
        assert finished == "length"
        assert [(e.code, e.request_id, e.fatal) for e in errors] == [("invalid_request", "bad", False)]
        assert "unclosed group" in errors[0].message
    finally:
        sock.close(0)
        ctx.term()
