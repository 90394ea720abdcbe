"""Run one table-printing benchmark in two source trees, rounds alternating the order, and compare.

    python scripts/bench_trees.py --old /tmp/old-tree --new . --rounds 3 --column "min us/step" \\
        -- scripts/bench_scheduler.py --steps 300

Each round runs ``python <tree>/<script> <args>`` with ``PYTHONPATH=<tree>`` in both trees, old first
in even rounds and new first in odd ones, so the machine's drift falls on both alike. The script
must print a markdown table whose first column names the row; ``--column`` picks the number
compared. Prints every round's value per tree, each tree's best (the minimum over rounds: on a
shared machine the other processes only ever add time), and new / old of the bests, with the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def parse_table(text: str, column: str) -> dict[str, float]:
    """Row name -> the value in ``column`` of the first markdown table in ``text``."""
    rows: dict[str, float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            if header is not None and rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(cells[0]) <= set("-: "):
            rows[cells[0]] = float(cells[header.index(column)])
    if header is None or column not in header:
        raise ValueError(f"no table with a column {column!r} in the output:\n{text}")
    return rows


def run_once(tree: Path, script: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(tree / script), *args], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed in {tree} ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def compare(runs: dict[str, list[dict[str, float]]]) -> str:
    rounds = len(runs["old"])
    names = list(runs["old"][0])
    width = max(len(n) for n in names)
    head = [f"old r{i + 1}" for i in range(rounds)] + [f"new r{i + 1}" for i in range(rounds)]
    head += ["old best", "new best", "new / old"]
    lines = ["| " + "workload".ljust(width) + " | " + " | ".join(head) + " |",
             "|" + "-" * (width + 2) + "|" + "|".join("-" * (len(h) + 1) + ":" for h in head) + "|"]
    for name in names:
        old = [r[name] for r in runs["old"]]
        new = [r[name] for r in runs["new"]]
        cells = [f"{v:.1f}" for v in old + new] + [f"{min(old):.1f}", f"{min(new):.1f}", f"{min(new) / min(old):.3f}"]
        lines.append("| " + name.ljust(width) + " | " + " | ".join(c.rjust(len(h)) for c, h in zip(cells, head)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the reference tree")
    p.add_argument("--new", type=Path, required=True, help="the tree under test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--column", default="min us/step", help="the table column compared")
    p.add_argument("script", help="the benchmark, relative to each tree (after --)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    trees = {"old": a.old.resolve(), "new": a.new.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    before = os.getloadavg()
    for r in range(a.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[which].append(parse_table(run_once(trees[which], a.script, a.args), a.column))
            print(f"round {r + 1} {which} done", file=sys.stderr, flush=True)
    after = os.getloadavg()
    print(f"{a.column}, {a.rounds} rounds alternating; load average {before[0]:.1f} before, {after[0]:.1f} after")
    print(compare(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
