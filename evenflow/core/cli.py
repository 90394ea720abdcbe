"""``engine-core`` console script: parse flags, start workers and the ROUTER, serve until a signal."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import time
from typing import Sequence

import zmq

from evenflow.protocol.curve import is_loopback
from evenflow.protocol.lifeline import die_with_parent
from evenflow.protocol.link_auth import read_secret

from evenflow.core.engine_config import ConfigError, EngineConfig, config_from_args
from evenflow.core.model_info import ModelInfo, read_model_info
from evenflow.core.workers import WorkerFailure


def config_and_model(argv: Sequence[str] | None) -> tuple[EngineConfig, ModelInfo]:
    """The engine's flags and the model they name, checked against each other (ConfigError)."""
    cfg = config_from_args(argv)
    info = read_model_info(cfg.model, cfg.served_model_name)
    if cfg.max_model_len is not None and cfg.max_model_len > info.max_model_len:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} exceeds the model's limit "
                          f"{info.max_model_len} (from {info.model_path})")
    return cfg, info


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine-core; returns its exit code (0 after SIGTERM/SIGINT, 1 on a failure)."""
    die_with_parent()  # when a launcher asked (evenflow serve): SIGTERM, a graceful stop, if it dies
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s",
                        stream=sys.stderr)
    log = logging.getLogger("evenflow.core.cli")
    try:
        cfg, info = config_and_model(argv)
        if cfg.nnodes > 1:
            read_secret(cfg.dist_secret_file)  # missing or short: a usage error, before anything starts
    except (ConfigError, ValueError, OSError) as e:
        # One line naming the value and what was expected (argparse's own errors carry the usage).
        print(f"engine-core: error: {e}", file=sys.stderr)
        return 2
    log.info("settings:\n%s", cfg.describe())
    log.info("token budget: %s", cfg.budget_description())
    if not is_loopback(cfg.listen) and cfg.curve_keys is None:
        log.warning("--listen %s is reachable from other hosts WITHOUT authentication or encryption: anyone who "
                    "can connect can submit requests (use --curve-keys DIR)", cfg.listen)
    log.info("model %s: %s, max_model_len %d, vocab %d, eos %s", info.model_name, info.architectures,
             info.max_model_len, info.vocab_size, info.eos_token_ids)

    if cfg.headless:
        from evenflow.core.headless import run_headless

        return run_headless(cfg, info)
    from evenflow.core.engine import EngineCore  # after flag errors, so `--help` and typos answer instantly

    engine = EngineCore(cfg, info)

    def on_signal(signum: int, _frame: object) -> None:
        engine.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        ready = engine.start()
    except (WorkerFailure, ValueError, zmq.ZMQError) as e:  # ZMQError: e.g. --listen address in use
        log.error("start-up failed: %s", e)
        engine.executor.shutdown(timeout=1.0)
        return 1
    log.info("engine-core %s serving %s on %s (start-up %.1f s, overlap %s)", ready.engine_id,
             ready.model_name, cfg.listen, time.monotonic() - t0, "on" if cfg.async_scheduling else "off")
    gc.freeze()  # start-up's objects live forever: keep full collections from rescanning them mid-step
    code = engine.run()
    log.info("engine-core exiting with code %d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
