"""Smoke run of scripts/bench_roofline.py on a tiny Q4_1 GGUF the tests write: the kernel table and
one roofline row per mode and round, every cell filled, the int4 row reading fewer weight bytes, a ratio summary
per row."""

from __future__ import annotations

from pathlib import Path

import gguf

from tests.bench.conftest import run_script
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


def test_bench_roofline_tiny_q4_gguf(checkpoint_root: Path, tmp_path: Path) -> None:
    model = write_gguf(make_checkpoint(checkpoint_root, seed=6), tmp_path / "tiny-q4_1.gguf",
                       gguf.GGMLQuantizationType.Q4_1)
    proc = run_script("bench_roofline.py", ["--model", str(model), "--modes", "float32,int4", "--batch", "1",
                                            "--context", "16", "--steps", "2", "--threads", "1", "--rounds", "2"],
                      timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read bandwidth" in proc.stdout
    *_, table, summary = proc.stdout.strip().split("\n\n")
    lines = table.splitlines()[2:]
    assert len(lines) == 4  # two modes, two rounds each (each its own bandwidth and step)
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}
    assert set(rows) == {"float32", "int4"}
    assert all(float(c) >= 0 for r in rows.values() for c in r[2:])
    assert float(rows["int4"][4]) < float(rows["float32"][4])  # weight MB a step reads
    assert len(summary.splitlines()) == 2 and all("over 2 rounds" in line for line in summary.splitlines())


def test_op_profile_and_revision_ab_on_a_tiny_q4_gguf(checkpoint_root: Path, tmp_path: Path) -> None:
    model = write_gguf(make_checkpoint(checkpoint_root, seed=6), tmp_path / "tiny-q4_1.gguf",
                       gguf.GGMLQuantizationType.Q4_1)
    proc = run_script("profile_decode_step.py", ["--model", str(model), "--modes", "int4", "--ops", "1",
                                                 "--context", "16", "--steps", "2"], timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "(2)" in rows["attention"] and "(1)" in rows["LM head"]  # the tiny model's 2 layers, one head
    assert "Python and dispatch" in rows and "**step (profiled)**" in rows
    proc = run_script("bench_decode_ab.py", ["--model", str(model), "--rev", "HEAD", "--rev", "WORKTREE",
                                             "--context", "16", "--steps", "2", "--rounds", "1"], timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| HEAD") or line.startswith("| WORKTREE")]
    assert len(table) == 2 and table[0].rstrip(" |").endswith("1.000")
