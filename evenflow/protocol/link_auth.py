"""Authenticated, encrypted links between an engine-core and its workers on other hosts.

Tensor parallel across hosts sends every step (prompts included) over TCP, so the links must not
accept strangers. Every host is given one shared secret (``--dist-secret-file`` or the
``EVENFLOW_DIST_SECRET`` variable); from it each side derives two CURVE key pairs, one for the
engine-core (server) and one for the workers (clients). The secret itself never crosses the wire:
a ZMQ CURVE handshake proves that both ends hold keys only the secret yields (the engine-core also
checks the client's public key through ZAP, so a peer without the secret fails the handshake), and
everything after it is encrypted. This is CURVE keyed by a shared secret, not per-host key pairs.

A link ends when its peer's host is gone, not when its process is slow (``watch_peer_host``): the
kernel's TCP keepalive probes, which a paused process's kernel still answers. (ZMQ's heartbeats are
answered by the peer's process: a SIGSTOPped engine-core dropped every worker link after 5 s, and
the steps it published while the workers resubscribed were lost to them, hanging the next step. No
bound on unacknowledged data either: Linux's TCP_USER_TIMEOUT also ends a link whose paused peer's
receive buffer is full.) Keepalive probes only an idle link, so a host that dies with a step sent to
it is heard through an idle link each headless host holds (evenflow/core/multi_node.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import zmq
from zmq.utils import z85

SECRET_ENV = "EVENFLOW_DIST_SECRET"
MIN_SECRET_BYTES = 16
KEEPALIVE_IDLE_S = 5  # an idle link is probed after this long ...
KEEPALIVE_INTERVAL_S = 1  # ... this often ...
KEEPALIVE_PROBES = 5  # ... and ends after this many unanswered probes (a dead host: ~10 s)


@dataclass(frozen=True)
class LinkKeys:
    """Z85-encoded CURVE keys derived from the shared secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    private = z85.encode(hashlib.sha256(b"evenflow-link-v1/" + role + b"/" + secret).digest())
    return zmq.curve_public(private), private


def derive_link_keys(secret: bytes) -> LinkKeys:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret must have at least {MIN_SECRET_BYTES} bytes")
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support: links across hosts cannot be secured")
    server_public, server_secret = _key_pair(secret, b"server")
    client_public, client_secret = _key_pair(secret, b"client")
    return LinkKeys(server_public, server_secret, client_public, client_secret)


def read_secret(path: str | None) -> bytes:
    """The shared secret: the file's content (stripped), else ``$EVENFLOW_DIST_SECRET``."""
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"tensor parallel across hosts needs a shared secret of at least {MIN_SECRET_BYTES} bytes "
                         f"on every host: --dist-secret-file FILE or ${SECRET_ENV}")
    return secret


def secure_server(sock: zmq.Socket, keys: LinkKeys) -> None:
    """Make a binding socket a CURVE server (call before bind; ZAP checks the client key)."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = b"evenflow-workers"
    watch_peer_host(sock)


def secure_client(sock: zmq.Socket, keys: LinkKeys) -> None:
    """Make a connecting socket a CURVE client of the engine-core (call before connect)."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    watch_peer_host(sock)


def watch_peer_host(sock: zmq.Socket) -> None:
    """End the socket's TCP connections when the peer's host stops answering (module docstring)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
