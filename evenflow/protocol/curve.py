"""CURVE (ZMQ's built-in encryption + authentication) for the frontend <-> engine-core link.

One folder holds the keys (``evenflow keygen DIR`` writes it):

    DIR/engine.key, DIR/engine.key_secret       the engine-core's key pair
    DIR/frontend.key, DIR/frontend.key_secret   a frontend key pair
    DIR/authorized_clients/*.key                 public keys the engine-core lets in

The engine-core (``--curve-keys DIR``) needs its pair and ``authorized_clients/``; a frontend
(``--curve-keys DIR``) needs its pair and ``engine.key`` (public). To add a frontend host, run
``evenflow keygen`` there and copy its ``frontend.key`` into the engine's ``authorized_clients/``
under a new name. A client whose key is not listed is not served: ZMQ's handshake fails and the
engine never sees a frame from it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED = "authorized_clients"


def generate_keys(folder: str | Path) -> Path:
    """Write an engine and a frontend key pair, authorizing the frontend's; secret files are 0600."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in ("engine", "frontend"):
        _, secret = zmq.auth.create_certificates(str(d), name)
        os.chmod(secret, 0o600)
    (d / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copy(d / "frontend.key", d / AUTHORIZED / "frontend.key")
    return d


def _pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    path = folder / f"{name}.key_secret"
    if not path.is_file():
        raise FileNotFoundError(f"no {path} (write the keys with `evenflow keygen {folder}`)")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


def serve_curve(ctx: zmq.Context, sock: zmq.Socket, folder: str | Path) -> ThreadAuthenticator:
    """Make ``sock`` (before it binds) a CURVE server that admits only the authorized public keys.
    Returns the running authenticator: stop it when the socket closes."""
    d = Path(folder)
    public, secret = _pair(d, "engine")
    if not (d / AUTHORIZED).is_dir():
        raise FileNotFoundError(f"no {d / AUTHORIZED} folder of authorized frontend keys")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(d / AUTHORIZED))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def connect_curve(sock: zmq.Socket, folder: str | Path) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the engine whose public key is in ``folder``."""
    d = Path(folder)
    public, secret = _pair(d, "frontend")
    server_public, _ = zmq.auth.load_certificate(str(d / "engine.key"))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def is_loopback(address: str) -> bool:
    """ipc:// and tcp:// on 127.0.0.0/8, ::1 or localhost; anything else (``*``, 0.0.0.0, a host) is remote."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
