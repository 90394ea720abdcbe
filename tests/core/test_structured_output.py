"""Structured output in the scheduler: compile off the loop (WAITING_FOR_FSM keeps its place),
per-step bitmasks, matchers advanced by accepted tokens, overlap, preemption, cache, failures."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.request import Request, RequestStatus
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.sched.structured_output import COMPILE_DELAY_ENV, COMPILE_DELAY_MARKER, StructuredOutputManager
from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput, StructuredOutputsParams

pytest.importorskip("llguidance")

EOS = 0
REGEX = "(ab|cd)-[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE (EOS at id 0), trained in a fraction of a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(['{"a": 1, "b": [true, false]} ab-12 cd-34 yes no maybe'] * 50, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def make(tokenizer_file: Path, **overrides: object) -> Scheduler:
    options: dict[str, object] = dict(num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256, block_size=4)
    options.update(overrides)
    manager = StructuredOutputManager(tokenizer_file, 320, [EOS])
    return Scheduler(SchedulerConfig(**options), manager)  # type: ignore[arg-type]


def add(scheduler: Scheduler, request_id: str, so: StructuredOutputsParams | None, max_tokens: int = 40) -> Request:
    request = Request(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, structured_outputs=so),
                      eos_token_ids=(EOS,))
    scheduler.add_request(request)
    return request


def wait_compiled(*requests: Request) -> None:
    for request in requests:
        request.grammar.compiled.result(timeout=30)  # type: ignore[union-attr]


def allowed_tokens(output: SchedulerOutput, req_id: str) -> np.ndarray:
    rows = np.frombuffer(output.grammar_bitmask, dtype="<i4").reshape(len(output.structured_output_req_ids), -1)
    row = rows[output.structured_output_req_ids.index(req_id)]
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def sample(output: SchedulerOutput, scheduler: Scheduler, rng: np.random.Generator) -> ModelRunnerOutput:
    """A model that picks a random allowed token for structured requests and 5 for the others."""
    req_ids, sampled = [], []
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        samples = request is not None and request.num_output_placeholders > 0
        token = int(rng.choice(allowed_tokens(output, req_id))) if req_id in output.structured_output_req_ids else 5
        req_ids.append(req_id)
        sampled.append([token] if samples else [])
    return ModelRunnerOutput(output.step_id, req_ids, sampled)


def decode(tokenizer_file: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).decode([t for t in ids if t != EOS])


def test_compiling_request_keeps_its_place_while_others_run(tokenizer_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_DELAY_ENV, "0.5")
    scheduler = make(tokenizer_file)
    compiling = add(scheduler, "fsm", StructuredOutputsParams(json='{"description":"%s","enum":["ab","cd"]}'
                                                                   % COMPILE_DELAY_MARKER))
    add(scheduler, "plain", None)
    assert compiling.status == RequestStatus.WAITING_FOR_FSM
    start = time.monotonic()
    output = scheduler.schedule()
    assert time.monotonic() - start < 0.2  # the compile did not run on the caller's thread
    assert set(output.num_scheduled_tokens) == {"plain"} and not output.structured_output_req_ids
    assert scheduler.waiting.peek() is compiling
    wait_compiled(compiling)
    output = scheduler.schedule()
    assert [new.req_id for new in output.scheduled_new_reqs] == ["fsm"]
    assert output.structured_output_req_ids == ["fsm"] and compiling.status == RequestStatus.RUNNING
    assert set(allowed_tokens(output, "fsm")) == {t for t in range(320) if decode(tokenizer_file, [t]) in ('"', '"a', '"ab', '"c', '"cd', '"ab"', '"cd"')}
    stats = scheduler.get_stats()
    assert sum(stats.grammar.compile_buckets) == 1 and stats.grammar.compile_s >= 0.5


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_follow_the_grammar_with_and_without_overlap(tokenizer_file: Path, overlap: bool) -> None:
    scheduler = make(tokenizer_file)
    rng = np.random.default_rng(0)
    specs = {"re": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=["yes", "no"]),
             "json": StructuredOutputsParams(json='{"properties":{"a":{"type":"boolean"}},"required":["a"],'
                                                  '"type":"object","additionalProperties":false}')}
    requests = {name: add(scheduler, name, so) for name, so in specs.items()}
    plain = add(scheduler, "plain", None, max_tokens=30)
    wait_compiled(*requests.values())
    in_flight: list[SchedulerOutput] = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        for name, request in requests.items():
            # A structured request never runs while its previous token is still in flight.
            assert not (name in output.num_scheduled_tokens and in_flight and name in in_flight[-1].structured_output_req_ids)
        in_flight.append(output)
        if len(in_flight) > (1 if overlap else 0):
            done = in_flight.pop(0)
            scheduler.update_from_output(done, sample(done, scheduler, rng))
    assert not scheduler.has_unfinished_requests()
    texts = {name: decode(tokenizer_file, list(r.output_token_ids)) for name, r in requests.items()}
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in requests.values()), texts
    assert re.fullmatch(REGEX, texts["re"]) and texts["choice"] in ("yes", "no")
    import json

    assert isinstance(json.loads(texts["json"])["a"], bool)
    assert plain.num_output_tokens == 30


def test_preempted_request_resumes_with_its_grammar_state(tokenizer_file: Path) -> None:
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    scheduler = make(tokenizer_file)
    rng = np.random.default_rng(1)
    request = add(scheduler, "re", StructuredOutputsParams(regex=REGEX))
    wait_compiled(request)
    for _ in range(2):
        output = scheduler.schedule()
        scheduler.update_from_output(output, sample(output, scheduler, rng))
    scheduler.running.remove(request)
    scheduler._preempt(request)  # what schedule() does to a victim when blocks run out
    output = scheduler.schedule()
    assert output.scheduled_cached_reqs[0].resumed_from_preemption
    reference = request.grammar.compiled.result().deep_copy()  # type: ignore[union-attr]
    assert reference.consume_tokens(list(request.output_token_ids))
    expected = allocate_token_bitmask(1, 320)
    fill_next_token_bitmask(reference, expected)
    assert list(allowed_tokens(output, "re")) == list(np.flatnonzero(np.unpackbits(expected[0].view(np.uint8),
                                                                                   bitorder="little")))
    while scheduler.has_unfinished_requests():
        scheduler.update_from_output(output, sample(output, scheduler, rng))
        output = scheduler.schedule()
    assert re.fullmatch(REGEX, decode(tokenizer_file, list(request.output_token_ids)))


def test_cache_shares_compiles_and_counts_hits(tokenizer_file: Path) -> None:
    scheduler = make(tokenizer_file)
    first = add(scheduler, "a", StructuredOutputsParams(regex=REGEX))
    second = add(scheduler, "b", StructuredOutputsParams(regex=REGEX))
    third = add(scheduler, "c", StructuredOutputsParams(choice=["yes"]))
    wait_compiled(first, second, third)
    assert first.grammar.compiled is second.grammar.compiled  # type: ignore[union-attr]
    stats = scheduler.get_stats()
    assert stats.grammar.cache_hits == 1 and sum(stats.grammar.compile_buckets) == 2


def test_bad_grammar_and_missing_library_are_refused_with_the_reason(tokenizer_file: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = make(tokenizer_file)
    with pytest.raises(ValueError, match="set exactly one"):
        add(scheduler, "two", StructuredOutputsParams(regex="a", choice=["b"]))
    assert not scheduler.has_unfinished_requests()
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    with pytest.raises(ValueError, match=r"evenflow\[structured\]"):
        add(make(tokenizer_file), "x", StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="^this engine-core does not serve structured output$"):
        Scheduler(SchedulerConfig(num_kv_blocks=16, max_num_batched_tokens=8, max_model_len=64, block_size=4)).add_request(
            Request("y", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))))


def test_bad_grammar_finishes_its_request_with_the_compilers_message(tokenizer_file: Path) -> None:
    scheduler = make(tokenizer_file)
    bad = add(scheduler, "bad", StructuredOutputsParams(regex="a(b"))  # validated off the loop too
    add(scheduler, "plain", None)
    with pytest.raises(ValueError):
        wait_compiled(bad)
    assert list(scheduler.schedule().num_scheduled_tokens) == ["plain"]
    [error] = scheduler.take_grammar_failures()
    assert error.code == "invalid_request" and error.request_id == "bad" and "unclosed group" in error.message
    assert bad.status == RequestStatus.FINISHED_ERROR and "bad" not in scheduler.requests
    assert scheduler.take_grammar_failures() == []
