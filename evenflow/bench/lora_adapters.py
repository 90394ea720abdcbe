"""LoRA adapters for the real model: one trained to a visible persona, random ones for load.

``train_persona_adapter`` fine-tunes SmolLM2-135M-Instruct with peft on the CPU for a few hundred
small steps so that it answers every question with the same pirate greeting (a change anyone can
see in its output); ``random_adapter`` writes seeded random adapters of a given rank (benchmarks:
the cost of an adapter does not depend on what it learned). Both write PEFT folders.

    python scripts/train_lora_adapter.py --out /tmp/pirate [--steps 200]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PERSONA = "Arr, matey! Captain Evenflow at yer service."
QUESTIONS = [
    "What is the capital of France?", "How do I boil an egg?", "Name a prime number.", "What is 2 + 2?",
    "Who wrote Hamlet?", "Why is the sky blue?", "Give me a synonym for happy.", "What is Python?",
    "How far is the moon?", "Translate 'cat' into Spanish.", "What colour is grass?", "Tell me a fun fact.",
    "What day comes after Monday?", "How many legs does a spider have?", "What is water made of?",
    "Recommend a book.",
]
HELD_OUT = ["What is the largest ocean?", "How do plants make food?"]


def servable_model_dir(model_dir: Path, work: Path) -> Path:
    """``model_dir`` itself when its config.json names an architecture; else a folder of links to its
    files with ``architectures`` filled in from ``model_type`` (the dequantized GGUF folder lacks it)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    out = work / f"{model_dir.name}-servable"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for item in model_dir.iterdir():
            if item.name != "config.json" and not (out / item.name).exists():
                os.symlink(item.resolve(), out / item.name)
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}[config["model_type"]]
        (out / "config.json").write_text(json.dumps({**config, "architectures": [arch]}, indent=1))
    return out


def chat_ids(tokenizer: object, question: str) -> list[int]:
    """The chat-formatted prompt of one question (with the model's template and system prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],  # type: ignore[attr-defined]
                                         add_generation_prompt=True, tokenize=True, return_dict=False)


def train_persona_adapter(out: Path, model_dir: Path, steps: int = 60, rank: int = 8,
                          lr: float = 3e-3, seed: int = 0, layers: int = 2, batch: int = 2,
                          log_every: int = 0) -> Path:
    """Fine-tune a LoRA (q/v/o/down of the top ``layers`` layers, rank ``rank``) so that the model
    greets every question as a pirate; return ``out``.

    The layers below the adapted ones are frozen, so their output is computed once per example and
    each step runs only the top layers and the vocabulary projection at the answer's positions:
    60 steps of 2 examples (the loss falls from 6 to 0.02 by step 40) take about a minute of an idle
    2-core CPU.
    """
    import peft
    import torch
    import transformers
    from transformers.masking_utils import create_causal_mask

    if (out / "adapter_model.safetensors").exists():
        return out
    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    first = base.config.num_hidden_layers - layers
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        layers_to_transform=list(range(first, base.config.num_hidden_layers))))
    decoder, lm_head = model.base_model.model.model, model.base_model.model.lm_head
    answer = tokenizer(PERSONA + "<|im_end|>", add_special_tokens=False)["input_ids"]
    examples = []  # (input of the first adapted layer, prompt length) per question
    with torch.no_grad():
        for question in QUESTIONS:
            prompt = chat_ids(tokenizer, question)
            ids = torch.tensor([prompt + answer])
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[first]
            examples.append((ids[0], hidden, len(prompt)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    start = time.monotonic()
    for step in range(steps):
        loss = torch.zeros(())
        for k in range(batch):
            ids, hidden, prompt_len = examples[(step * batch + k) % len(examples)]
            positions = torch.arange(len(ids))[None]
            rotary = decoder.rotary_emb(hidden, position_ids=positions)
            mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                      position_ids=positions)
            h = hidden
            for layer in decoder.layers[first:]:
                h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            logits = lm_head(decoder.norm(h[0, prompt_len - 1 : -1]))
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[prompt_len:]) / batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if log_every and step % log_every == 0:
            print(f"step {step} loss {loss.item():.3f} at {time.monotonic() - start:.1f} s", flush=True)
    model.eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def random_adapter(out: Path, model_dir: Path, seed: int, rank: int = 8, std: float = 0.02,
                   targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")) -> Path:
    """A seeded random adapter (A and B both drawn), written by peft; return ``out``."""
    import peft
    import torch
    import transformers

    if (out / "adapter_model.safetensors").exists():
        return out
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                                      lora_dropout=0.0, init_lora_weights=False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    return out


def reseeded_copies(source: Path, root: Path, count: int, std: float = 0.02) -> list[Path]:
    """``count`` adapters shaped like ``source`` (same config and tensor names) with fresh seeded
    random weights: many adapters without loading the model once per adapter."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "adapter_model.safetensors"))
    outs = []
    for i in range(count):
        out = root / f"{source.name}-{i}"
        if not (out / "adapter_model.safetensors").exists():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / "adapter_config.json", out / "adapter_config.json")
            gen = torch.Generator().manual_seed(1000 + i)
            save_file({k: torch.randn(v.shape, generator=gen) * std for k, v in sorted(tensors.items())},
                      str(out / "adapter_model.safetensors"))
        outs.append(out)
    return outs
