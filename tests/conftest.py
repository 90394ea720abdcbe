from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_root: Path) -> Path:
    """A 2-layer random Llama (GQA 4/2 heads, vocab 256) in HuggingFace format."""
    return make_checkpoint(checkpoint_root)
