"""The engine-core's ROUTER side, in-process: handshake, strict decoding, validation, liveness.

No scheduler and no workers: FrontendLink's inbox is read directly, so these tests are fast.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from evenflow.core.frontend_link import ClientGone, ClientMessage, FrontendLink
from evenflow.protocol import (
    PROTOCOL_VERSION, Abort, AddRequest, Codec, EngineToFrontend, Error, Heartbeat, Hello, Outputs, Ready,
    RequestOutput, SamplingParams, SchedulerCounts, SchedulerStats, UtilityCall,
)

READY = Ready(PROTOCOL_VERSION, "m", "/m", 64, 100, [2], 16, 32, 256, "eid")
MAX_FRAME = 4096


class Peer:
    """A synchronous DEALER talking to the link."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec: Codec[EngineToFrontend] = Codec(EngineToFrontend)

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(self.codec.encode(msg))

    def recv(self, timeout: float = 5.0) -> EngineToFrontend:
        assert self.sock.poll(int(timeout * 1000)), "no reply from the link"
        return self.codec.decode(self.sock.recv())

    def hello(self) -> Ready:
        self.send(Hello(PROTOCOL_VERSION, "peer"))
        ready = self.recv()
        assert isinstance(ready, Ready)
        return ready


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def make_link(ctx: zmq.Context, tmp_path: Path, client_timeout: float = 30.0) -> FrontendLink:
    link = FrontendLink(ctx, f"ipc://{tmp_path}/link.sock", READY, max_frame_bytes=MAX_FRAME,
                        client_timeout=client_timeout)
    link.start()
    return link


@pytest.fixture
def link(ctx: zmq.Context, tmp_path: Path) -> Iterator[FrontendLink]:
    lk = make_link(ctx, tmp_path)
    yield lk
    lk.close()


@pytest.fixture
def peer(ctx: zmq.Context, tmp_path: Path, link: FrontendLink) -> Peer:
    return Peer(ctx, f"ipc://{tmp_path}/link.sock")


def expect_error(peer: Peer, code: str, request_id: str | None = None) -> Error:
    msg = peer.recv()
    assert isinstance(msg, Error), msg
    assert msg.code == code, msg
    assert msg.request_id == request_id
    return msg


def test_handshake_and_heartbeat(peer: Peer, link: FrontendLink) -> None:
    assert peer.hello() == READY
    link.set_stats(SchedulerStats(scheduler=SchedulerCounts(num_running=3)))
    peer.send(Heartbeat())
    msg = peer.recv()
    assert isinstance(msg, Outputs) and msg.outputs == [] and msg.stats.scheduler.num_running == 3


def test_version_mismatch_names_both_versions(peer: Peer) -> None:
    peer.send(Hello(PROTOCOL_VERSION + 41, "old"))
    err = expect_error(peer, "version_mismatch")
    assert err.fatal and str(PROTOCOL_VERSION + 41) in err.message and str(PROTOCOL_VERSION) in err.message


def test_message_before_hello_is_refused(peer: Peer, link: FrontendLink) -> None:
    peer.send(AddRequest("r", [1, 2]))
    expect_error(peer, "no_hello")
    assert link.inbox.empty()


@pytest.mark.parametrize("frame", [
    b"\xc1garbage",                                              # not msgpack
    msgspec.msgpack.encode(["no_such_tag", 1]),                  # unknown tag
    msgspec.msgpack.encode(["request", 5, [1, 2]]),              # request_id of the wrong type
    msgspec.msgpack.encode({"not": "an array"}),
    b"",
    msgspec.msgpack.encode(["request", "r", list(range(2000))]),  # over MAX_FRAME bytes
])
def test_bad_frames_get_an_error_and_the_link_keeps_serving(peer: Peer, link: FrontendLink, frame: bytes) -> None:
    peer.hello()
    peer.sock.send(frame)
    expect_error(peer, "bad_frame")
    peer.send(Heartbeat())
    assert isinstance(peer.recv(), Outputs)
    assert link.inbox.empty()


@pytest.mark.parametrize("sampling_params, fragment", [
    ({"max_tokens": 16.0}, "sampling_params.max_tokens"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos"),
    ({"n": 2}, "unknown key `n`"),
    ({"seed": 2**64 - 1}, "sampling_params.seed"),
    ({"stop_token_ids": [1, 2**63]}, "sampling_params.stop_token_ids[1]"),
    ([16], "sampling_params: Expected `map`"),
])
def test_bad_sampling_params_are_refused_with_the_request_id_and_the_field(
        peer: Peer, link: FrontendLink, sampling_params: object, fragment: str) -> None:
    peer.hello()
    peer.sock.send(msgspec.msgpack.encode(["request", "r7", [1, 2], sampling_params]))
    err = expect_error(peer, "invalid_request", "r7")
    assert fragment in err.message
    assert link.inbox.empty()


@pytest.mark.parametrize("frame, fragment", [
    (["request", "r7", ["x"]], "prompt_token_ids[0]: Expected `int`"),
    (["request", "r7", [1, 2**64 - 1]], "prompt_token_ids[1]"),
    (["request", "r7", [1], {}, 2**63], "priority"),
    (["request", "r7", [1], {}, 0, "now"], "arrival_time"),
])
def test_bad_request_fields_are_refused_with_the_request_id(peer: Peer, link: FrontendLink, frame: list,
                                                            fragment: str) -> None:
    peer.hello()
    peer.sock.send(msgspec.msgpack.encode(frame))
    assert fragment in expect_error(peer, "invalid_request", "r7").message
    assert link.inbox.empty()


@pytest.mark.parametrize("frame, fragment", [
    (["utility", 2**63, "get_stats"], "call_id"),
    (["hello", 2**64 - 1], "protocol_version"),
])
def test_integers_outside_int64_are_bad_frames(peer: Peer, link: FrontendLink, frame: list, fragment: str) -> None:
    peer.hello()
    # (msgpack has no integer below int64's minimum: uint64 is the only way out of range)
    peer.sock.send(msgspec.msgpack.encode(frame))
    err = expect_error(peer, "bad_frame")
    assert fragment in err.message and "int64" in err.message
    peer.send(UtilityCall(2**63 - 1, "get_stats"))  # the largest int64 is fine
    assert link.inbox.get(timeout=5).msg.call_id == 2**63 - 1


def test_arity_errors_count_fields_after_the_tag_both_ways(peer: Peer) -> None:
    peer.hello()
    peer.sock.send(msgspec.msgpack.encode(["request", "r"]))
    few = expect_error(peer, "bad_frame").message
    peer.sock.send(msgspec.msgpack.encode(["request", "r", [1], {}, 0, 0.0, 0.0, "a", "extra"]))
    many = expect_error(peer, "bad_frame").message
    rule = "`request` takes 2 to 7 fields after its tag"
    assert few.startswith(rule) and few.endswith("got 1"), few
    assert many.startswith(rule) and many.endswith("got 8"), many
    peer.sock.send(msgspec.msgpack.encode(["utility", 1]))
    assert expect_error(peer, "bad_frame").message.startswith("`utility` takes 2 to 3 fields after its tag")


def test_before_hello_bad_frames_come_first_then_no_hello_in_wire_words(peer: Peer, link: FrontendLink) -> None:
    peer.sock.send(b"\xc1")
    expect_error(peer, "bad_frame")  # undecodable: bad_frame even before hello
    peer.sock.send(msgspec.msgpack.encode(["request", "r", [1], {"n": 2}]))
    assert expect_error(peer, "no_hello").message == "send hello before request"
    peer.send(Heartbeat())
    assert expect_error(peer, "no_hello").message == "send hello before heartbeat"
    peer.send(Abort(["r"]))
    assert expect_error(peer, "no_hello").message == "send hello before abort"
    assert link.inbox.empty()


def test_hello_again_keeps_the_clients_live_requests(peer: Peer, link: FrontendLink) -> None:
    peer.hello()
    peer.send(AddRequest("r1", [1, 2, 3]))
    first = link.inbox.get(timeout=5)
    peer.hello()  # answered with ready; the client stays the same client
    link.send(first.identity, Outputs([RequestOutput("r1", [7])]))
    out = peer.recv()
    assert isinstance(out, Outputs) and out.outputs[0].request_id == "r1"
    peer.send(AddRequest("r2", [1]))
    second = link.inbox.get(timeout=5)
    assert isinstance(second, ClientMessage) and second.client_index == first.client_index
    assert link.inbox.empty()  # no ClientGone


def test_wrong_version_hello_from_a_registered_client_changes_nothing(peer: Peer, link: FrontendLink) -> None:
    peer.hello()
    peer.send(Hello(PROTOCOL_VERSION + 1, "confused"))
    assert expect_error(peer, "version_mismatch").fatal
    peer.send(Heartbeat())
    assert isinstance(peer.recv(), Outputs)  # still registered
    assert link.inbox.empty()


def test_multipart_message_is_refused(peer: Peer) -> None:
    peer.hello()
    peer.sock.send_multipart([msgspec.msgpack.encode(Heartbeat()), b"extra"])
    expect_error(peer, "bad_frame")


@pytest.mark.parametrize("request_, fragment", [
    (AddRequest("r", []), "empty"),
    (AddRequest("r", [1, 100]), "100"),
    (AddRequest("r", [-1]), "-1"),
    (AddRequest("r", [1], SamplingParams(max_tokens=-3)), "max_tokens"),
    (AddRequest("r", [1], SamplingParams(top_p=0.0)), "top_p"),
    (AddRequest("r", [1] * 60, SamplingParams(max_tokens=10)), "70"),  # names both 60 and 10 too
    (AddRequest("", [1]), "request_id"),
    (AddRequest("r", [1], arrival_time=float("nan")), "arrival_time"),
    (AddRequest("r", [1], SamplingParams(temperature=float("inf"))), "temperature"),
])
def test_invalid_requests_are_refused_with_their_id(peer: Peer, link: FrontendLink, request_: AddRequest,
                                                    fragment: str) -> None:
    peer.hello()
    peer.send(request_)
    err = expect_error(peer, "invalid_request", request_.request_id)
    assert fragment in err.message
    assert link.inbox.empty()


def test_valid_messages_reach_the_inbox_and_outputs_route_back(peer: Peer, link: FrontendLink) -> None:
    peer.hello()
    peer.send(AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4)))
    peer.send(Abort(["r1"]))
    first, second = link.inbox.get(timeout=5), link.inbox.get(timeout=5)
    assert isinstance(first, ClientMessage) and isinstance(first.msg, AddRequest)
    assert first.msg.prompt_token_ids == [1, 2, 3] and first.client_index == 0
    assert isinstance(second.msg, Abort)
    link.send(first.identity, Outputs([RequestOutput("r1", [7], "length")]))
    out = peer.recv()
    assert isinstance(out, Outputs) and out.outputs[0].new_token_ids == [7]
    link.broadcast(Error("engine_shutdown", "bye", fatal=True))
    expect_error(peer, "engine_shutdown")


def test_closed_socket_is_noticed_long_before_the_timeout(ctx: zmq.Context, tmp_path: Path,
                                                           link: FrontendLink) -> None:
    a, b = Peer(ctx, f"ipc://{tmp_path}/link.sock"), Peer(ctx, f"ipc://{tmp_path}/link.sock")
    a.hello()
    b.hello()
    t0 = time.monotonic()
    a.sock.close(0)
    gone = link.inbox.get(timeout=5)
    assert isinstance(gone, ClientGone) and gone.client_index == 0
    assert time.monotonic() - t0 < 2.5  # the client timeout is 30 s: the disconnect probe found it
    b.send(Heartbeat())
    assert isinstance(b.recv(), Outputs)  # the other client is untouched (probes are empty Outputs)


def test_silent_client_is_dropped_and_told_so(ctx: zmq.Context, tmp_path: Path) -> None:
    lk = make_link(ctx, tmp_path, client_timeout=0.5)
    try:
        p = Peer(ctx, f"ipc://{tmp_path}/link.sock")
        p.hello()
        p.send(AddRequest("old", [1]))
        identity = lk.inbox.get(timeout=3).identity
        gone = lk.inbox.get(timeout=3)
        assert isinstance(gone, ClientGone) and "silent" in gone.reason
        told = expect_error(p, "client_dropped")  # unsolicited: the client sent nothing since
        assert "dropped" in told.message and "send hello, then resubmit" in told.message
        # Until the engine loop has handled the ClientGone, what it sends that client is stale.
        lk.send(identity, Outputs([RequestOutput("old", [5])]))
        p.send(Heartbeat())
        expect_error(p, "no_hello")  # forgotten: it must say hello again
        p.hello()
        p.send(AddRequest("old", [1]))  # the same id, resubmitted
        assert lk.inbox.get(timeout=3).msg.request_id == "old"
        lk.gone_handled(identity)
        lk.send(identity, Outputs([RequestOutput("old", [6])]))
        out = p.recv()
        assert isinstance(out, Outputs) and out.outputs[0].new_token_ids == [6], out  # [5] never came
    finally:
        lk.close()


def test_frames_over_twice_the_limit_drop_the_connection(ctx: zmq.Context, tmp_path: Path) -> None:
    lk = make_link(ctx, tmp_path)
    try:
        p = Peer(ctx, f"ipc://{tmp_path}/link.sock")
        p.hello()
        p.sock.send(b"\x00" * (2 * MAX_FRAME))  # the largest frame that still gets an answer
        assert "exceeds the limit of 4096" in expect_error(p, "bad_frame").message
        p.sock.send(b"\x00" * (2 * MAX_FRAME + 1))  # ZMQ_MAXMSGSIZE: the connection is closed
        gone = lk.inbox.get(timeout=5)
        assert isinstance(gone, ClientGone) and gone.reason == "disconnected"
        assert not p.sock.poll(200)  # no answer to that frame
        p.send(Heartbeat())  # the DEALER reconnected by itself, as a new peer
        expect_error(p, "no_hello")
    finally:
        lk.close()


_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_FUZZ_FRAMES = st.one_of(
    st.binary(max_size=64),
    st.lists(st.one_of(st.sampled_from(["request", "abort", "hello", "utility", "heartbeat", "zzz"]),
                       _INT64, st.text(max_size=4), st.lists(_INT64, max_size=4), st.none(),
                       st.floats(allow_nan=True)), max_size=6).map(msgspec.msgpack.encode),
)


def test_fuzzed_frames_never_break_the_link(ctx: zmq.Context, tmp_path: Path) -> None:
    lk = make_link(ctx, tmp_path)
    peer = Peer(ctx, f"ipc://{tmp_path}/link.sock")
    peer.hello()

    @settings(max_examples=80, deadline=None)
    @given(frame=_FUZZ_FRAMES)
    def check(frame: bytes) -> None:
        peer.sock.send(frame)
        peer.send(Heartbeat())
        # Whatever the frame was, the heartbeat's Outputs arrives, after at most one other reply.
        replies = [peer.recv()]
        if not isinstance(replies[0], Outputs):
            replies.append(peer.recv())
        assert isinstance(replies[-1], Outputs), replies
        assert all(isinstance(r, (Outputs, Error, Ready)) for r in replies)
        while peer.sock.poll(20):  # a fuzzed Heartbeat has a second Outputs in flight
            peer.recv()
        while True:  # a fuzzed frame may be a valid request: drain what reached the engine side
            try:
                lk.inbox.get_nowait()
            except queue.Empty:
                break

    try:
        check()
    finally:
        lk.close()
