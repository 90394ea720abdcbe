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
    RequestOutput, SamplingParams, SchedulerStats,
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
    link.set_stats(SchedulerStats(num_running=3))
    peer.send(Heartbeat())
    msg = peer.recv()
    assert isinstance(msg, Outputs) and msg.outputs == [] and msg.stats.num_running == 3


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
    msgspec.msgpack.encode(["request", "r", ["x"]]),             # token ids of the wrong type
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


def test_silent_client_is_dropped(ctx: zmq.Context, tmp_path: Path) -> None:
    lk = make_link(ctx, tmp_path, client_timeout=0.5)
    try:
        p = Peer(ctx, f"ipc://{tmp_path}/link.sock")
        p.hello()
        gone = lk.inbox.get(timeout=3)
        assert isinstance(gone, ClientGone) and "silent" in gone.reason
        p.send(Heartbeat())
        expect_error(p, "no_hello")  # forgotten: it must say Hello again
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
