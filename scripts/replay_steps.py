#!/usr/bin/env python3
"""Replay a served worker's steps alone and compare their times, by kind of step.

Record while serving (the worker writes PREFIX.config.json, PREFIX.frames, PREFIX.steps.jsonl):

    EVENFLOW_STEP_RECORD=/tmp/run1 evenflow serve --model M ...

then, with the server stopped and the machine otherwise quiet:

    python scripts/replay_steps.py /tmp/run1

The replay runs the same steps (shapes, block ids) in this process with nothing beside it;
served / replayed is what the processes around the worker cost each kind of step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evenflow.worker.omp_env import quiet_omp_waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", type=Path, help="the EVENFLOW_STEP_RECORD prefix of the recording")
    args = ap.parse_args()
    quiet_omp_waits()  # as a worker does, before torch loads
    from evenflow.bench.step_replay import compare, format_comparison, replay
    from evenflow.worker.step_record import read_steps

    replayed = replay(args.prefix)
    served = read_steps(args.prefix)
    print(format_comparison(compare(served, replayed.timings)))


if __name__ == "__main__":
    main()
