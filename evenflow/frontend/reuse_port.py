"""The one SO_REUSEPORT socket setup: ``evenflow serve`` reserves the port with it, each frontend listens with it."""

from __future__ import annotations

import socket


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (and SO_REUSEADDR), not yet listening.

    Every process that binds this way shares the port; the kernel spreads connections over the
    listening ones. Bound but not listening, it reserves the port (``port=0`` picks a free one).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
