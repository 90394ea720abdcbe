"""Hypothesis fuzz of the decoders: any bytes give a well-typed message or a DecodeError, nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from evenflow.protocol import (
    PROTOCOL_VERSION, Abort, AddRequest, Codec, DecodeError, EngineToFrontend, EngineToWorker, Error,
    FrontendToEngine, Heartbeat, Hello, Hold, ModelRunnerOutput, Outputs, Ready, RequestOutput, SamplingParams,
    SchedulerCounts, SchedulerStats, UtilityCall, WorkerToEngine,
)

UNIONS = {
    "frontend->engine": (FrontendToEngine, (Hello, AddRequest, Abort, Hold, Heartbeat, UtilityCall)),
    "engine->frontend": (EngineToFrontend, None),
    "engine->worker": (EngineToWorker, None),
    "worker->engine": (WorkerToEngine, None),
}
TAGS = ["hello", "request", "abort", "heartbeat", "utility", "ready", "outputs", "error", "utility_result",
        "sched", "mro", "worker_ready", "init_kv", "shutdown", "worker_error", "bogus"]

_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_leaf = st.one_of(st.none(), st.booleans(), _int64, st.floats(), st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=12)
# Frames shaped like messages (a tag then fields) reach deeper into the decoders than random bytes.
_tagged = st.tuples(st.sampled_from(TAGS), st.lists(_value, max_size=8)).map(
    lambda t: msgspec.msgpack.encode([t[0], *t[1]]))
FRAMES = st.one_of(st.binary(max_size=256), _tagged)


def _decode_or_refuse(codec: Codec, frame: bytes, expected: tuple | None) -> None:
    try:
        msg = codec.decode(frame)
    except DecodeError as e:
        assert str(e)  # the reason is readable, so the Error reply can carry it
        return
    if expected is not None:
        assert isinstance(msg, expected)
    assert isinstance(msg, msgspec.Struct)


@pytest.mark.parametrize("direction", list(UNIONS))
@settings(max_examples=120, deadline=None)
@given(frame=FRAMES)
def test_any_frame_decodes_to_the_union_or_raises_decode_error(direction: str, frame: bytes) -> None:
    union, expected = UNIONS[direction]
    _decode_or_refuse(Codec(union), frame, expected)


def test_oversize_frame_is_refused_before_parsing() -> None:
    codec = Codec(FrontendToEngine, max_frame_bytes=100)
    with pytest.raises(DecodeError, match="exceeds the limit of 100"):
        codec.decode(codec.encode(AddRequest("r", list(range(200)))))


_params = st.builds(SamplingParams, max_tokens=st.integers(1, 10**6), temperature=st.floats(0, 2),
                    seed=st.none() | st.integers(0, 2**32), stop_token_ids=st.lists(st.integers(0, 10**5)))
_requests = st.builds(AddRequest, request_id=st.text(min_size=1, max_size=16),
                      prompt_token_ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64),
                      sampling_params=_params, priority=_int64, arrival_time=st.floats(0, 2e9))


@settings(max_examples=200, deadline=None)
@given(msg=st.one_of(_requests, st.builds(Abort, st.lists(st.text(max_size=8))),
                     st.builds(Hello, st.integers(0, 2**31), st.text(max_size=8)), st.just(Heartbeat()),
                     st.builds(UtilityCall, st.integers(0, 2**31), st.text(max_size=16))))
def test_every_frontend_message_round_trips(msg: msgspec.Struct) -> None:
    codec = Codec(FrontendToEngine)
    assert codec.decode(codec.encode(msg)) == msg


def test_engine_messages_round_trip_and_stay_small() -> None:
    codec = Codec(EngineToFrontend)
    stats = SchedulerStats(scheduler=SchedulerCounts(num_running=256))
    outs = Outputs([RequestOutput(f"r{i}", [i]) for i in range(256)], stats, 1.0)
    frame = codec.encode(outs)
    assert codec.decode(frame) == outs
    # array_like: a one-token delta costs a few bytes beyond its id (one nil per unset field).
    assert len(frame) < 256 * 14 + 200
    err = Error("invalid_request", "bad", "r1")
    assert codec.decode(codec.encode(err)) == err
    assert Codec(WorkerToEngine).decode(msgspec.msgpack.encode(ModelRunnerOutput(3, ["a"], [[1]]))).step_id == 3


def test_protocol_version_is_a_positive_int() -> None:
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1


def test_ready_carries_max_frame_bytes_and_accepts_an_older_engines_shorter_array() -> None:
    codec = Codec(EngineToFrontend)
    ready = Ready(PROTOCOL_VERSION, "m", "/m", 64, 100, [2], 16, 32, 256, "eid", 65536)
    assert codec.decode(codec.encode(ready)) == ready
    older = msgspec.msgpack.encode(["ready", PROTOCOL_VERSION, "m", "/m", 64, 100, [2], 16, 32, 256, "eid"])
    decoded = codec.decode(older)
    assert isinstance(decoded, Ready) and decoded.engine_id == "eid" and decoded.max_frame_bytes == 0
