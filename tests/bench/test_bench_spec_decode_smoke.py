"""Smoke test of scripts/bench_spec_decode.py end to end: a copy model trained for a few steps,
two engine-cores (speculation off and on), one request per cell; the table and the JSON come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.conftest import run_script


@pytest.mark.slow
def test_bench_spec_decode_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cells.json"
    result = run_script("bench_spec_decode.py", [
        "--model-dir", str(tmp_path / "copy-model"), "--train-steps", "3", "--rounds", "1", "--concurrency", "1",
        "--num-requests", "2", "--max-tokens", "6", "--no-load-switch", "--out", str(out),
    ], timeout_s=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| copy | 1 | ngram |" in result.stdout and "| free | 1 | off |" in result.stdout
    cells = json.loads(out.read_text())
    assert {(c["setting"], c["workload"]) for c in cells} == {(s, w) for s in ("off", "ngram") for w in ("copy", "free")}
    assert all(c["output_tokens"] == 2 * 6 for c in cells)  # 2 requests of 6 tokens per cell
    assert all(c["draft_tokens"] == 0 for c in cells if c["setting"] == "off")
    assert json.loads((tmp_path / "copy-model" / "training.json").read_text())["steps"] == 3
