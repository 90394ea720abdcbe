"""The short chaos run (scripts/chaos.py --quick): every fault kind under load, then the ledger's
promises: nothing lost or duplicated, no KV block leaked, no process left, greedy unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def _row(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {name} |")).split("|")[2].strip()


def test_short_chaos_run_keeps_every_promise(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--duration", "20", "--quick"], capture_output=True,
                         text=True, timeout=400, cwd=tmp_path)
    table = run.stdout
    assert "| requests sent |" in table, run.stdout[-3000:] + run.stderr[-3000:]
    assert int(_row(table, "requests sent")) > 20
    assert int(_row(table, "completed")) > 0
    assert int(_row(table, "lost (sent, never ended)")) == 0
    assert int(_row(table, "duplicated outputs")) == 0
    assert _row(table, "KV blocks leaked after quiesce") == "parts: 0, serve: 0"
    assert int(_row(table, "orphan processes")) == 0
    assert _row(table, "greedy probes equal to idle / different").endswith("/ 0")
    assert "bad" not in _row(table, "malformed HTTP bodies: answers")
    assert run.returncode == 0, table
