"""Smoke runs of the benchmark scripts that drive the engine itself (seconds each, tiny models):
each runs as a user would run it, finishes, and prints its table with every row filled in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.bench.conftest import run_script


def _table_rows(text: str) -> list[list[str]]:
    """Cells of each markdown table row whose second cell is a number (headers and separators left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [r for r in rows if len(r) > 1 and re.fullmatch(r"[\d.]+", r[1])]


def test_bench_scheduler_runs_every_workload() -> None:
    proc = run_script("bench_scheduler.py", ["--steps", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _table_rows(proc.stdout)
    names = [r[0] for r in rows]
    assert names[:3] == ["64 decodes", "256 decodes", "1024 decodes"] and names[3].startswith("mixed")
    assert all(float(cell) > 0 for r in rows for cell in r[1:])


def test_bench_offline_tiny_batches() -> None:
    proc = run_script("bench_offline.py", ["--models", "tiny", "--dtypes", "float32", "--batch-sizes", "1", "4",
                                           "--min-prompt", "16", "--max-prompt", "40", "--output-len", "4",
                                           "--threads", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = proc.stdout.strip().split("\n\n")[-1].splitlines()
    assert final[0].split()[:3] == ["model", "dtype", "batch"]
    rows = [line.split() for line in final[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("tiny", "float32", "1"), ("tiny", "float32", "4")]
    assert all(float(r[4]) > 0 for r in rows)  # output tokens per second
    assert all(int(r[6]) >= 4 for r in rows)  # at least output-len steps ran


@pytest.mark.slow
def test_bench_overlap_on_and_off_and_the_wire() -> None:
    proc = run_script("bench_overlap.py", ["--preset", "tiny", "--concurrency", "4", "--seconds", "1",
                                           "--warmup", "0.5", "--device", "cpu", "--wire-messages", "200"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r[0]: r for r in _table_rows(proc.stdout)}
    assert set(rows) == {"on", "off", "1", "256"}
    assert float(rows["on"][1]) > 0 and float(rows["off"][1]) > 0  # steps/s with overlap on and off
    assert float(rows["1"][1]) > 0 and float(rows["256"][1]) > 0  # wire messages/s


@pytest.mark.slow
def test_bench_frontend_one_and_two_frontends() -> None:
    proc = run_script("bench_frontend.py", ["--streams", "4", "--requests", "8", "--max-tokens", "8",
                                            "--step-ms", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["frontends"] for r in results] == [1, 2]
    assert all(r["tokens"] == 8 * 8 and r["tokens_per_s"] > 0 for r in results)  # every token delivered


def test_profile_step_time_fits_a_small_grid(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    proc = run_script("profile_step_time.py", ["--model-dir", str(tiny_llama), "--repeats", "1", "--threads", "1",
                                               "--decodes", "0,2", "--decode-contexts", "24,40", "--chunks", "0,8,16",
                                               "--chunk-contexts", "0,16"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    shapes = [line for line in lines if re.match(r"\s*\d+\s+\d+\s+\d+\s+\d+ \|", line)]
    # 2 decode contexts x (no chunk + 2 chunks x 2 contexts) with decodes, plus 4 chunk-only shapes
    assert len(shapes) == 2 * 5 + 4
    mixed = [line for line in shapes if line.count("|") == 3]
    assert len(mixed) == 8 and all(float(line.split("|")[1].split()[0]) > 0 for line in shapes)
    assert lines[-1].startswith("median |error| of a step:")



def test_profile_step_time_lists_the_decodes_alone_without_a_zero_chunk_context(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Each chunk's own cost is measured against its decodes alone: they are timed even when
    --chunk-contexts has no 0."""
    proc = run_script("profile_step_time.py", ["--model-dir", str(tiny_llama), "--repeats", "1", "--threads", "1",
                                               "--decodes", "2", "--decode-contexts", "24", "--chunks", "0,8",
                                               "--chunk-contexts", "16"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    shapes = [line.split("|")[0].split() for line in proc.stdout.splitlines()
              if re.match(r"\s*\d+\s+\d+\s+\d+\s+\d+ \|", line)]
    assert shapes == [["2", "24", "0", "0"], ["2", "24", "8", "16"]]

def test_bench_trees_compares_a_tree_with_itself_round_by_round() -> None:
    repo = str(Path(__file__).resolve().parents[2])
    proc = run_script("bench_trees.py", ["--old", repo, "--new", repo, "--rounds", "2", "--",
                                         "scripts/bench_scheduler.py", "--steps", "3"], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _table_rows(proc.stdout)
    assert [r[0] for r in rows][:3] == ["64 decodes", "256 decodes", "1024 decodes"]
    for r in rows:  # old r1, old r2, new r1, new r2, the two bests (the minima), their ratio
        old, new = [float(c) for c in r[1:3]], [float(c) for c in r[3:5]]
        assert (float(r[5]), float(r[6])) == (min(old), min(new))
        assert float(r[7]) == pytest.approx(min(new) / min(old), abs=1e-3)
