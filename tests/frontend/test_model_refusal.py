"""A refused ``--model``: one line naming the path and what was expected, from ``engine-core`` and
from ``evenflow serve``, which says nothing about serving before its engine-core is ready."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port


def _refusals(tmp_path: Path) -> list[Path]:
    not_a_model = tmp_path / "empty-folder"
    not_a_model.mkdir()
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a model")
    return [tmp_path / "missing-folder", not_a_model, text_file]


def _stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_engine_core_refuses_a_model_in_one_line(tmp_path: Path, which: int) -> None:
    model = _refusals(tmp_path)[which]
    result = subprocess.run([sys.executable, "-m", "evenflow.core.cli", "--model", str(model),
                             "--listen", f"ipc://{tmp_path}/e.sock"], capture_output=True, text=True, timeout=60)
    lines = _stderr_lines(result)
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert str(model) in lines[0] and "config.json" in lines[0], lines[0]


def test_serve_refuses_a_model_in_one_line_and_never_says_serving(tmp_path: Path) -> None:
    model = _refusals(tmp_path)[1]
    result = subprocess.run([sys.executable, "-m", "evenflow.frontend", "serve", "--model", str(model),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "serving" not in result.stdout + result.stderr
    errors = [line for line in _stderr_lines(result) if "error" in line.lower()]
    assert len(errors) == 1 and str(model) in errors[0] and "config.json" in errors[0], result.stderr
