"""Fixtures for the benchmark smoke tests: a fake server process, and running a script as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
FAKE_SERVER = Path(__file__).resolve().parent / "fake_openai_server.py"
from evenflow.bench.server import ManagedServer, ServerSpec, free_port


def fake_server_cmd(extra: str = "") -> str:
    """A command template the sweep/peer scripts format with {port} and {budget}."""
    return f"{sys.executable} {FAKE_SERVER} --port {{port}} --max-num-batched-tokens {{budget}} {extra}".strip()


@pytest.fixture()
def fake_server(tmp_path: Path) -> Iterator[str]:
    """A running fake OpenAI-compatible server (budget 256); yields its base URL, stops it by PID."""
    port = free_port()
    argv = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--max-num-batched-tokens", "256"]
    spec = ServerSpec("fake", argv, {}, port, tmp_path / "fake.log", ready_timeout_s=30)
    with ManagedServer(spec) as server:
        yield server.spec.base_url


@pytest.fixture()
def fake_model_dir(tmp_path: Path) -> Path:
    """A folder with just the config.json fields the scripts read (vocab, length, KV shapes)."""
    folder = tmp_path / "model"
    folder.mkdir()
    cfg = dict(vocab_size=512, max_position_embeddings=2048, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, hidden_size=64)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def run_script(script: str, args: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` as the user would. On timeout it gets SIGTERM first, so that its own
    ``finally`` stops the servers it started, then SIGKILL; either way the test fails."""
    argv = [sys.executable, str(SCRIPTS / script), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{script} timed out after {timeout_s} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
