"""PEFT LoRA adapters for tests: random ones on the seeded checkpoints, and the reference outputs.

An adapter is written by peft itself (``save_pretrained``), so the folder layout and tensor names
are exactly what users bring; its weights are drawn from a seed and scaled so that greedy outputs
visibly differ from the base model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evenflow.protocol.lora import AdapterRef, adapter_identity, read_adapter

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapter(model_dir: Path, out: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                        targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, std: float = 0.3) -> Path:
    """Write a PEFT adapter with seeded random A and B for ``model_dir`` to ``out``; return ``out``."""
    import peft
    import torch
    import transformers

    if (out / "adapter_model.safetensors").exists():
        return out
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    return out


def adapter_ref(name: str, path: Path, max_lora_rank: int = 16) -> AdapterRef:
    """The reference the engine-core would make for this folder."""
    config = read_adapter(path, max_lora_rank)
    return AdapterRef(name, adapter_identity(path, config), str(path), config.rank)


_PEFT_CACHE: dict[tuple[str, str], Any] = {}


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by transformers + peft in float32 (the base model when no adapter)."""
    import torch

    from tests.checkpoints import reference_greedy

    if adapter_dir is None:
        return reference_greedy(model_dir, prompt, max_tokens)
    key = (str(model_dir), str(adapter_dir))
    if key not in _PEFT_CACHE:
        import peft
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
        _PEFT_CACHE[key] = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    model = _PEFT_CACHE[key]
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()
