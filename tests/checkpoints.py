"""Seeded random-weight HuggingFace checkpoints for tests, written with transformers itself.

Nothing is downloaded: each checkpoint is built from a config, saved as safetensors, and reused
for the whole test session (cached per configuration).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_checkpoint(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight checkpoint for ``TINY_LLAMA | overrides`` under ``root``; return its folder.

    ``model_type`` picks the transformers class (llama, qwen2, qwen3, mistral). Weights are drawn
    with ``torch.manual_seed(seed)`` and scaled up (std 0.2) so that greedy choices are not ties.
    """
    import torch
    import transformers

    cfg = dict(TINY_LLAMA)
    cfg.update(overrides)
    key = json.dumps(cfg, sort_keys=True) + f"|{seed}"
    name = f"{cfg['model_type']}-{abs(hash_str(key)) % 10**12}"
    out = root / name
    if (out / "config.json").exists():
        return out
    config_cls = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, out) if not out.exists() else None
    return out


def hash_str(s: str) -> int:
    """A stable (unsalted) hash so the same config maps to the same folder in every process."""
    import hashlib

    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little")


def reference_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` by transformers in float32 (the reference)."""
    import torch

    model = _load_reference(str(model_dir))
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is a real token here, not padding
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_tokens,
        )
    return out[0, len(prompt):].tolist()


_REF_CACHE: dict[str, Any] = {}


def _load_reference(model_dir: str) -> Any:
    import torch
    import transformers

    if model_dir not in _REF_CACHE:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        m.eval()
        _REF_CACHE[model_dir] = m
    return _REF_CACHE[model_dir]
