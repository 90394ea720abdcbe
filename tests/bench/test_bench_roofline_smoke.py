"""Smoke run of scripts/bench_roofline.py on a tiny Q4_1 GGUF the tests write: the kernel table and
one roofline row per mode, every cell filled, the int4 row reading fewer weight bytes."""

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
                                            "--context", "16", "--steps", "2", "--threads", "1"], timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read bandwidth" in proc.stdout
    table = proc.stdout.strip().split("\n\n")[-1].splitlines()[2:]
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)}
    assert set(rows) == {"float32", "int4"}
    assert all(float(c) >= 0 for r in rows.values() for c in r[2:])
    assert float(rows["int4"][4]) < float(rows["float32"][4])  # weight MB a step reads
