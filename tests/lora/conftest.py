from __future__ import annotations

from pathlib import Path

import pytest

from tests.lora_adapters import make_random_adapter


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random PEFT adapters on the tiny Llama: every target (rank 4), attention-only rsLoRA (rank 8),
    MLP-only (rank 2)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_random_adapter(tiny_llama, root / "all", seed=1),
        "attn": make_random_adapter(tiny_llama, root / "attn", seed=2, rank=8, alpha=4.0,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True),
        "mlp": make_random_adapter(tiny_llama, root / "mlp", seed=3, rank=2, alpha=16.0,
                                   targets=("gate_proj", "up_proj", "down_proj")),
    }


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model (real BPE tokenizer, random weights): what the HTTP tests serve."""
    from evenflow.frontend.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
