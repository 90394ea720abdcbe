"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

import torch
from evenflow.worker.config_reader import SUPPORTED_ARCHITECTURES, ModelConfig
from evenflow.worker.models.llama import LlamaModel
from evenflow.worker.parallel import TensorParallel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {arch: LlamaModel for arch in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> LlamaModel:
    """Instantiate the (empty) model for ``cfg.architecture``; weights come from the loader."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported model architecture {cfg.architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    return cls(cfg, tp, dtype, device, max_model_len)
