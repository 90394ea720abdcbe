"""scripts/gpu_check.sh (it runs on CUDA machines only): it parses, its dry run prints the plan, every
file it runs exists, and without a GPU it says so and exits 2."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_check_parses_and_its_dry_run_lists_every_step() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    plan = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    names = " ".join(plan)
    for needed in ("cuda unit tests", "reference float16", "reference bfloat16", "flash/triton/torch",
                   "bench_offline 1b"):
        assert needed in names
    limits = [int(m.group(1)) for line in plan for m in [re.search(r"\s(\d+)s\s", line)] if m]
    assert len(limits) == len(plan) and sum(limits) >= 480  # the 470 s budget, not the limits, bounds the run
    for line in plan:
        for word in shlex.split(line):
            if word.endswith((".py", ".sh")):
                assert (ROOT / word).is_file(), word


def test_gpu_check_without_a_gpu_refuses_clearly() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the real run is the test there")
    proc = _run()
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
