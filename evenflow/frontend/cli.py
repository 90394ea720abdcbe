"""Command lines: ``evenflow-frontend`` (one HTTP frontend) and ``evenflow serve`` (engine + N frontends).

``evenflow-frontend --engine ADDR`` attaches to a running engine-core: it connects first, loads the
tokenizer from the folder the engine names, and only then opens its port (SO_REUSEPORT, so many
frontends may share it). ``evenflow serve`` launches one engine-core and N frontends on one port,
with a shared metrics folder, and stops all of them on Ctrl-C. Without ``--model`` it serves the
built-in demo model (random weights). Flags it does not know go to the engine-core.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Sequence


from evenflow.protocol.lifeline import die_with_parent

from evenflow.frontend.flags import add_frontend_flags, http_limits, routing_config
from evenflow.frontend.api.server import ServerConfig, build_app, connect_context, reuseport_socket, serve_app


def frontend_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evenflow-frontend", description="One OpenAI-compatible HTTP frontend "
                                "attached to a running engine-core.")
    p.add_argument("--engine", action="append", default=None,
                   help="engine-core address (its --listen; default tcp://127.0.0.1:7100); repeat it to route "
                        "requests among several engine-cores (data parallel)")
    add_frontend_flags(p)
    p.add_argument("--connect-timeout", type=float, default=600.0, help="seconds to wait for the engine-core")
    p.add_argument("--no-log-stats", dest="log_stats", action="store_false", help="no periodic throughput log")
    p.add_argument("--frontend-name", default=None, help="name in logs and in the metrics folder")
    p.add_argument("--curve-keys", default=None,
                   help="folder from `evenflow keygen DIR` (frontend.key_secret, engine.key): CURVE-encrypt and "
                        "authenticate the link to an engine-core started with --curve-keys")
    return p


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")


async def _run_frontend(args: argparse.Namespace) -> None:
    import uvloop  # noqa: F401  (the loop we run on; imported here to fail early when missing)

    config = ServerConfig(
        engine_address=args.engine[0], engine_addresses=args.engine, routing=routing_config(args), api_key=args.api_key, served_model_name=args.served_model_name,
        chat_template=args.chat_template, tokenizer=args.tokenizer, log_stats=args.log_stats,
        connect_timeout=args.connect_timeout, frontend_name=args.frontend_name,
        metrics_dir=os.environ.get("EVENFLOW_METRICS_DIR"), max_body_bytes=args.max_request_body_bytes,
        curve_keys=args.curve_keys, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        engine_timeout=args.engine_timeout, http_limits=http_limits(args),
        timeout_keep_alive=args.timeout_keep_alive, stuck_reader_timeout=args.stuck_reader_timeout,
    )
    log = logging.getLogger("evenflow.frontend")
    config.http_limits.max_connections = _fit_connections_to_fd_limit(config.http_limits.max_connections, log)
    if (warning := open_port_warning(args.host, args.api_key)) is not None:
        log.warning(warning)
    ctx = await connect_context(config)

    async def given() -> object:
        return ctx

    sock = reuseport_socket(args.host, args.port)
    gc.freeze()  # start-up's objects (tokenizer, app) live forever: keep full collections from rescanning them
    log.info("serving %s (max_model_len %d) on http://%s:%d, engine %s", ctx.model_name, ctx.max_model_len,
             args.host, sock.getsockname()[1], ", ".join(args.engine))
    try:
        await serve_app(build_app(config, given), sock, config)  # type: ignore[arg-type]
    finally:
        sock.close()


def open_port_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for an HTTP port other hosts can reach with no API key required."""
    if api_key or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return None
    return (f"serving on --host {host} without an API key: anyone who can reach this port can use it "
            f"(set EVENFLOW_API_KEY or --api-key)")


def _fit_connections_to_fd_limit(wanted: int, log: logging.Logger) -> int:
    """Raise the soft file-descriptor limit to the hard one (systemd's soft default is 1024), and keep
    --max-connections below it, with room for the engine link, logs and the metrics folder."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    room = max(16, soft - 64)
    if wanted > room:
        log.warning("--max-connections %d lowered to %d: the file-descriptor limit is %d", wanted, room, soft)
        return room
    return wanted


def frontend_main(argv: Sequence[str] | None = None) -> int:
    """``evenflow-frontend``: serve HTTP against an engine-core until SIGINT/SIGTERM."""
    parser = frontend_parser()
    args = parser.parse_args(argv)
    die_with_parent()  # when a launcher asked (evenflow serve): never outlive it
    args.engine = args.engine or ["tcp://127.0.0.1:7100"]
    try:
        routing_config(args).validate()
        if len(set(args.engine)) != len(args.engine):
            raise ValueError(f"--engine lists an engine-core twice: {args.engine}")
    except ValueError as e:
        parser.error(str(e))
    _setup_logging(args.frontend_name or f"frontend-{os.getpid()}")
    import uvloop

    try:
        uvloop.run(_run_frontend(args))
    except KeyboardInterrupt:
        pass
    except Exception as e:  # connect failures, a taken port: one clear line, not a traceback
        logging.getLogger("evenflow.frontend").error("%s: %s", type(e).__name__, e)
        return 1
    return 0


def keygen_main(argv: Sequence[str]) -> int:
    """``evenflow keygen DIR``: CURVE key pairs for the engine-core link (evenflow/protocol/curve.py)."""
    p = argparse.ArgumentParser(prog="evenflow keygen", description="Write an engine-core and a frontend CURVE "
                                "key pair into DIR and authorize the frontend's public key.")
    p.add_argument("dir", help="key folder (created; secret files are readable by you only)")
    args = p.parse_args(list(argv))
    from evenflow.protocol.curve import generate_keys

    d = generate_keys(args.dir)
    print(f"wrote {d}/engine.key(_secret), {d}/frontend.key(_secret), {d}/authorized_clients/frontend.key\n"
          f"  engine-core --curve-keys {d} --listen tcp://HOST:PORT --allow-remote ...\n"
          f"  evenflow-frontend --curve-keys {d} --engine tcp://HOST:PORT ...")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``evenflow``: subcommands ``serve`` and ``keygen``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: evenflow serve [--model DIR] [--frontends N] [--host H] [--port P] [frontend flags] "
              "[engine-core flags]\n\n  serve   start one engine-core and N HTTP frontends on one port "
              "(the built-in demo model when --model is not given)\n  keygen DIR   write CURVE key pairs for "
              "engine-core/evenflow-frontend --curve-keys DIR")
        return 0 if argv else 2
    if argv[0] == "serve":
        from evenflow.frontend.serve import serve_main

        return serve_main(argv[1:])
    if argv[0] == "keygen":
        return keygen_main(argv[1:])
    print(f"evenflow: unknown command {argv[0]!r} (try: evenflow serve, evenflow keygen DIR)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(frontend_main())
