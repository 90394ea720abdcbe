"""Loopback ports for tests whose clients dial before the server listens (torch.distributed's
rendezvous, ZMQ links between hosts)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def loopback_ports(count: int) -> int:
    """A port p with p .. p+count-1 free on 127.0.0.1 now, below the kernel's ephemeral range: a client
    that keeps dialling a port nobody listens on yet takes a fresh ephemeral source port each try, and one
    of those may be the very port (held, or connected to itself), so the server's bind fails and the
    start-up hangs. Ports the kernel never hands out as source ports cannot be taken that way."""
    low = _ephemeral_low()
    bottom = 10000 if low - count > 10000 else 1024  # clear of well-known services where the range allows
    for _ in range(500):
        port = random.randrange(bottom, low - count)
        held: list[socket.socket] = []
        try:
            for p in range(port, port + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} free consecutive loopback ports below {low}")


def free_port() -> int:
    """One such port: for a server its clients poll until it listens."""
    return loopback_ports(1)
