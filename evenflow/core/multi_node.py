"""Tensor parallel across hosts: where the ranks live, the secured links, and a lost-host watch.

Node 0 runs the engine-core and ranks ``[0, local)``; node ``r`` runs ``engine-core --headless``
(headless.py), which starts ranks ``[r * local, (r + 1) * local)`` with ``local = tp / nnodes``.
All ranks join torch.distributed at ``tcp://MASTER_ADDR:MASTER_PORT`` (gloo on CPU, NCCL on GPU),
as vLLM's multiprocessing backend does. The engine-core's step broadcast (XPUB) and results (PULL)
bind ``tcp://MASTER_ADDR:MASTER_PORT+1`` and ``+2``: only on the interface that address names,
and as CURVE servers keyed by the hosts' shared secret (evenflow/protocol/link_auth.py).

A host that dies (its launcher killed, the machine gone) drops its TCP connections. Only a peer
that passed the CURVE handshake can subscribe to the step broadcast, and with XPUB_VERBOSER the
engine-core hears an unsubscription whenever such a subscriber's connection ends: that is a lost
host, treated as a lost worker. TCP keepalive ends an idle link to a host that stops answering within
~10 s (a paused process is a slow step: link_auth.py), but a step link is never idle while a step
sent to a dead host waits unacknowledged on it (the kernel retransmits for ~15 min instead). So each
headless host also holds ``watch_from_host``: one more subscription to the step broadcast, to a topic
no step starts with, an always idle link whose end within ~10 s of the host's is heard the same way.
A stranger failing the handshake never subscribed, so it cannot fake either.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

from evenflow.protocol.link_auth import (
    SECRET_ENV, LinkKeys, derive_link_keys, read_secret, secure_client, secure_server,
)

from evenflow.core.engine_config import EngineConfig

log = logging.getLogger("evenflow.core.multi_node")

HOST_WATCH_TOPIC = b"\xc1evenflow-host-watch"  # 0xc1 begins no msgpack value: no step is ever sent to it
RANK_SUBSCRIPTION = b"\x01"  # what XPUB_VERBOSE reads when a rank subscribes to every step

@dataclass(frozen=True)
class NodeLayout:
    """Where ranks run and how they meet, from the ``--nnodes`` flags."""

    nnodes: int
    node_rank: int
    world_size: int
    master_addr: str
    master_port: int
    keys: LinkKeys
    secret: bytes = field(repr=False, default=b"")

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "NodeLayout":
        """From the validated flags; reads the shared secret (ValueError when it is missing or short)."""
        secret = read_secret(cfg.dist_secret_file)
        return cls(cfg.nnodes, cfg.node_rank, cfg.tensor_parallel_size, cfg.master_addr, cfg.master_port,
                   derive_link_keys(secret), secret)

    def worker_env(self) -> dict[str, str]:
        """The environment of this host's ranks: the secret travels here, never on a command line."""
        return dict(os.environ, **{SECRET_ENV: self.secret.decode()})

    def _tcp(self, port: int) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{port}"

    @property
    def dist_init_addr(self) -> str:
        return self._tcp(self.master_port)

    @property
    def steps_addr(self) -> str:
        return self._tcp(self.master_port + 1)

    @property
    def results_addr(self) -> str:
        return self._tcp(self.master_port + 2)

    def local_ranks(self) -> range:
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


class SecuredLinks:
    """The engine-core's side: ZAP authentication of workers, and the lost-host watch."""

    def __init__(self, ctx: zmq.Context, layout: NodeLayout, steps: zmq.Socket, results: zmq.Socket) -> None:
        self.layout = layout
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("evenflow-workers", credentials_provider=_OnlyKey(layout.keys.client_public))
        for sock in (steps, results):
            secure_server(sock, layout.keys)
        steps.setsockopt(zmq.XPUB_VERBOSER, 1)  # an unsubscription for every subscriber that leaves
        try:
            steps.bind(layout.steps_addr)
            results.bind(layout.results_addr)
        except zmq.ZMQError:  # e.g. a port in use: no authenticator thread left behind
            self._auth.stop()
            raise
        self._steps = steps
        self.lost: str | None = None
        log.info("worker links for %d hosts on %s (steps) and %s (results), CURVE keyed by the shared secret; "
                 "rendezvous %s", layout.nnodes, layout.steps_addr, layout.results_addr, layout.dist_init_addr)

    def check(self) -> str | None:
        """Read pending (un)subscriptions (call after start-up); return why a host was lost, or None."""
        while self.lost is None and self._steps.poll(0):
            if self._steps.recv()[:1] == b"\x00":
                self.lost = (f"lost a worker host: its connection to {self.layout.steps_addr} ended (its "
                             f"launcher or machine died, or the network failed)")
        return self.lost

    def close(self) -> None:
        self._auth.stop()


def watch_from_host(ctx: zmq.Context, layout: NodeLayout) -> zmq.Socket:
    """A headless host's idle link to the engine-core (module docstring); close it when leaving."""
    sock = ctx.socket(zmq.SUB)
    secure_client(sock, layout.keys)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, HOST_WATCH_TOPIC)
    sock.connect(layout.steps_addr)
    return sock


class _OnlyKey:
    """ZAP credentials provider: accept exactly the workers' key derived from the shared secret."""

    def __init__(self, public_key: bytes) -> None:
        self._key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key
