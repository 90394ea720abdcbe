from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.scenarios import References, Runners


@pytest.fixture(scope="session")
def runners(tiny_llama: Path) -> Runners:
    """Model runners of the tiny Llama, one per block size, shared by every scenario test."""
    return Runners(tiny_llama)


@pytest.fixture(scope="session")
def references(tiny_llama: Path) -> References:
    """Transformers greedy continuations, cached per prompt for the whole session."""
    return References(tiny_llama)
