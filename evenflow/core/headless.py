"""``engine-core --headless``: this host's tensor-parallel ranks, for an engine-core on another host.

It starts ranks ``[node_rank * tp / nnodes, ...)`` with the same settings as the engine-core (the
operator gives both the same flags, as with vLLM), pointed at node 0's rendezvous and links, and
then only watches them: the ranks take their steps from the engine-core directly. It returns 0 when
every rank exited cleanly (the engine-core shut them down), 1 with the cause when one failed (the
engine-core hears of it through its lost link or rank 0's collectives), and stops its ranks on
SIGTERM/SIGINT. Its ranks exit by themselves if it dies, which the engine-core sees as a lost host;
if the machine dies, its idle watch link ends and says so within ~10 s (``watch_from_host``).
"""

from __future__ import annotations

import logging
import signal
import time

import msgspec
import zmq

from evenflow.core.engine_config import EngineConfig
from evenflow.core.model_info import ModelInfo
from evenflow.core.multi_node import NodeLayout, watch_from_host
from evenflow.core.component_configs import worker_template
from evenflow.core.workers import describe_exit, spawn_worker

log = logging.getLogger("evenflow.core.headless")


def run_headless(cfg: EngineConfig, info: ModelInfo) -> int:
    layout = NodeLayout.from_config(cfg)
    template = worker_template(cfg, info.model_path, cfg.max_model_len or info.max_model_len)
    stop: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, _f: stop.append(signal.Signals(signum).name))
    signal.signal(signal.SIGINT, lambda signum, _f: stop.append(signal.Signals(signum).name))
    ctx = zmq.Context()
    watch = watch_from_host(ctx, layout)  # the engine-core hears this host die within ~10 s
    procs = {rank: spawn_worker(msgspec.structs.replace(
        template, rank=rank, dist_init_addr=layout.dist_init_addr, engine_input_addr=layout.steps_addr,
        engine_output_addr=layout.results_addr, secure_link=True), layout.worker_env())
        for rank in layout.local_ranks()}
    log.info("node %d of %d: ranks %s for the engine-core at %s", layout.node_rank, layout.nnodes,
             list(procs), layout.steps_addr)
    try:
        while not stop:
            exited = {rank: p.returncode for rank, p in procs.items() if p.poll() is not None}
            if exited and all(code == 0 for code in exited.values()) and len(exited) == len(procs):
                log.info("every rank exited cleanly (the engine-core shut them down)")
                return 0
            failed = {rank: code for rank, code in exited.items() if code != 0}
            if failed:
                log.error("stopping this host: %s", "; ".join(
                    f"worker rank {rank} (pid {procs[rank].pid}) {describe_exit(code)}" for rank, code in failed.items()))
                return 1
            time.sleep(0.2)
        log.info("%s: stopping this host's ranks", stop[0])
        return 0
    finally:
        for p in procs.values():  # ranks ignore SIGTERM (the engine-core decides): SIGKILL the ones left
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            p.wait()
        watch.close(0)
        ctx.term()
