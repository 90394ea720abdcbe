from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from evenflow.protocol.lifeline import RUNTIME_DIR_ENV
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_root: Path) -> Path:
    """A 2-layer random Llama (GQA 4/2 heads, vocab 256) in HuggingFace format."""
    return make_checkpoint(checkpoint_root)


@pytest.fixture(scope="session", autouse=True)
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Engine-cores the tests start (and SIGKILL) keep their worker sockets here, not in /tmp:
    ``EVENFLOW_RUNTIME_DIR`` is what a launcher names for its children (evenflow/protocol/lifeline.py)."""
    path = tmp_path_factory.mktemp("runtime")
    before = os.environ.get(RUNTIME_DIR_ENV)
    os.environ[RUNTIME_DIR_ENV] = str(path)
    yield path
    if before is None:
        os.environ.pop(RUNTIME_DIR_ENV, None)
    else:
        os.environ[RUNTIME_DIR_ENV] = before
