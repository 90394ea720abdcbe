from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.frontend.demo_model import ensure_demo_model
from evenflow.frontend.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model (real BPE tokenizer, random weights), written once per session."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir)
