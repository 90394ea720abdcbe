"""One tensor-parallel rank for tests: replay recorded SchedulerOutputs, write rank 0's outputs.

    python -m tests.worker.tp_rank CONFIG_JSON STEPS_FILE OUT_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
from evenflow.protocol import SchedulerOutput, WorkerConfig


def main(config_json: str, steps_file: str, out_file: str) -> None:
    from evenflow.worker.runner import ModelRunner

    cfg = msgspec.json.decode(config_json, type=WorkerConfig)
    steps = msgspec.msgpack.decode(Path(steps_file).read_bytes(), type=list[SchedulerOutput])
    runner = ModelRunner(cfg)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    outputs = []
    for so in steps:
        out = runner.execute_model(so)
        assert (out is None) == (cfg.rank != 0)
        if out is not None:
            outputs.append(out)
    runner.shutdown()
    if cfg.rank == 0:
        Path(out_file).write_bytes(msgspec.msgpack.encode(outputs))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.exit(0)
