"""Links to workers on other hosts: only a peer holding the shared secret gets through, and a peer
that was connected and drops is reported as a lost host (a stranger's failed handshake is not), also
when the host stops answering with a step sent to it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from evenflow.core.engine_config import ConfigError, EngineConfig
from evenflow.core.multi_node import RANK_SUBSCRIPTION, NodeLayout, SecuredLinks, watch_from_host
from evenflow.protocol.link_auth import derive_link_keys, secure_client
from tests.ports import loopback_ports

SECRET = b"a-shared-secret-of-some-length"


def _secured_links(ctx: zmq.Context) -> tuple[NodeLayout, SecuredLinks, zmq.Socket, zmq.Socket]:
    """The links on a free port triple; another process may take a port between the check and the
    bind (the machine is shared), so a bind that finds it taken tries another triple."""
    for _ in range(20):
        steps, results = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
        layout = NodeLayout(2, 0, 2, "127.0.0.1", loopback_ports(3), derive_link_keys(SECRET), SECRET)
        try:
            return layout, SecuredLinks(ctx, layout, steps, results), steps, results
        except zmq.ZMQError as e:
            steps.close(0)
            results.close(0)
            if e.errno != errno.EADDRINUSE:
                raise
    raise RuntimeError("every port triple tried was taken before it could be bound")


def _client(ctx: zmq.Context, secret: bytes, address: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    secure_client(sub, derive_link_keys(secret))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    return sub


def _wait(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_only_the_secret_gets_through_and_a_dropped_host_is_lost() -> None:
    ctx = zmq.Context()
    layout, links, steps, results = _secured_links(ctx)
    try:
        stranger = _client(ctx, b"not-the-secret-at-all-no", layout.steps_addr)
        friend = _client(ctx, SECRET, layout.steps_addr)
        assert _wait(lambda: steps.poll(0) and steps.recv()[:1] == b"\x01")  # the friend's subscription
        steps.send(b"step")
        assert friend.poll(5000) and friend.recv() == b"step"
        assert not stranger.poll(500)  # the handshake failed: nothing reaches it
        stranger.close(0)
        time.sleep(0.3)
        assert links.check() is None  # a stranger leaving is not a lost host
        friend.close(0)
        assert _wait(lambda: links.check() is not None)
        assert "lost a worker host" in (links.lost or "")
    finally:
        links.close()
        steps.close(0)
        results.close(0)
        ctx.term()


def test_a_hosts_watch_link_takes_no_step_and_its_end_is_a_lost_host() -> None:
    ctx = zmq.Context()
    layout, links, steps, results = _secured_links(ctx)
    try:
        watch = watch_from_host(ctx, layout)
        assert _wait(lambda: steps.poll(0) > 0)
        subscription = steps.recv()
        assert subscription != RANK_SUBSCRIPTION  # start-up does not count it as a rank's
        steps.send(b"\x82step")  # a step starts with a msgpack value's first byte, never 0xc1
        assert not watch.poll(300)
        assert links.check() is None
        watch.close(0)
        assert _wait(lambda: links.check() is not None)
    finally:
        links.close()
        steps.close(0)
        results.close(0)
        ctx.term()


def _may_blackhole() -> bool:
    """Whether this machine lets a test make a network namespace with routing rules by port."""
    if not (shutil.which("unshare") and shutil.which("ip")) or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "rule", "add", "dport", "1", "ipproto", "tcp", "blackhole"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _may_blackhole(), reason="needs root, unshare -n and ip rule's port selectors")
def test_a_host_that_stops_answering_with_a_step_sent_to_it_is_lost_within_seconds() -> None:
    """Keepalive does not probe a link with data waiting for its acknowledgement (the kernel retransmits
    it for ~15 min): without the host's idle watch link, only --step-timeout (600 s) noticed."""
    script = Path(__file__).with_name("blackholed_host.py")
    run = subprocess.run(["unshare", "-n", sys.executable, str(script), str(loopback_ports(3))],
                         capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    seconds, _, why = run.stdout.strip().partition(" ")
    assert "lost a worker host" in why, run.stdout
    assert float(seconds) < 20  # keepalive: 5 s idle, 5 probes 1 s apart


def test_node_flags_are_validated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text("{}")
    base = dict(model=str(tmp_path), tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1")
    EngineConfig(**base).validate()
    EngineConfig(**base, node_rank=1, headless=True).validate()
    for bad, match in [(dict(master_addr=""), "master-addr"), (dict(tensor_parallel_size=3), "split evenly"),
                       (dict(node_rank=1), "headless"), (dict(node_rank=2, headless=True), "node-rank"),
                       (dict(headless=True), "headless")]:
        with pytest.raises(ConfigError, match=match):
            EngineConfig(**{**base, **bad}).validate()
    with pytest.raises(ConfigError, match="nnodes > 1"):
        EngineConfig(model=str(tmp_path), headless=True).validate()
