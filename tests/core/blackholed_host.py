"""Run in a network namespace of its own (``unshare -n``, test_multi_node.py): the engine-core's links
to a headless host that stops answering, with a step sent to it and never acknowledged. ``ip rule``
blackholes the link's ports: packets vanish as on a dead machine, where a closed process would reset
the connections. Prints the seconds until the engine-core calls the host lost, and why."""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from evenflow.core.multi_node import RANK_SUBSCRIPTION, NodeLayout, SecuredLinks, watch_from_host
from evenflow.protocol.link_auth import derive_link_keys, secure_client

SECRET = b"a-shared-secret-of-some-length"


def main(port: int) -> None:
    for command in (["ip", "link", "set", "lo", "up"], ["ip", "rule", "del", "pref", "0"],
                    ["ip", "rule", "add", "lookup", "local", "pref", "100"]):  # the blackholes come first
        subprocess.run(command, check=True)
    ctx = zmq.Context()
    layout = NodeLayout(2, 0, 2, "127.0.0.1", port, derive_link_keys(SECRET), SECRET)
    steps, results = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
    links = SecuredLinks(ctx, layout, steps, results)
    rank = ctx.socket(zmq.SUB)  # the host's rank, taking every step
    secure_client(rank, layout.keys)
    rank.setsockopt(zmq.SUBSCRIBE, b"")
    rank.connect(layout.steps_addr)
    watch = watch_from_host(ctx, layout)
    subscriptions: list[bytes] = []
    while len(subscriptions) < 2:
        if steps.poll(5000):
            subscriptions.append(steps.recv())
    assert sorted(subscriptions).count(RANK_SUBSCRIPTION) == 1, subscriptions
    steps.send(b"step-1")
    assert rank.poll(5000) and rank.recv() == b"step-1" and not watch.poll(200)
    assert links.check() is None
    for ports in (f"{port + 1}", f"{port + 2}"):
        for side in ("dport", "sport"):
            subprocess.run(["ip", "rule", "add", side, ports, "ipproto", "tcp", "blackhole", "pref", "5"], check=True)
    start = time.monotonic()
    steps.send(b"step-2" * 20_000)  # sent to the dead host: never acknowledged
    while links.check() is None and time.monotonic() - start < 60:
        time.sleep(0.1)
    print(f"{time.monotonic() - start:.1f} {links.lost}")
    links.close()
    for sock in (rank, watch, steps, results):
        sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main(int(sys.argv[1]))
