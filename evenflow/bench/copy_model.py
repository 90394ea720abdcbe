"""Train a tiny 2-layer Llama that really copies, for speculative decoding benchmarks and tests.

Random weights do not copy text, so n-gram drafts on them say little. This trains, on the CPU in a
few minutes of one core, a model on sequences made of random content (marker ``COPY``) followed
by a span of that content again, from a random offset. Only the repeat is scored: the one way to
predict it is to find the current token earlier and take the one after it, so the model forms
induction heads, the mechanism that makes real LLMs quote their prompt.

It saves a HuggingFace folder (config.json + model.safetensors, float32), loadable by evenflow and
transformers. No tokenizer: benchmarks send token ids.

    python scripts/train_copy_model.py --out /tmp/copy-model [--steps 600] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

VOCAB = 256
EOS, COPY, FREE = 0, 1, 2
FIRST_CONTENT = 4  # ids below are special
SEQ_LEN = 64


def copy_sequence(rng: np.random.Generator, length: int) -> tuple[np.ndarray, int]:
    """COPY, random content, then the content again from a random offset (to the end), and the
    index where the repeat starts."""
    content_len = int(rng.integers(length // 3, length // 2 + 8))
    content = rng.integers(FIRST_CONTENT, VOCAB, size=content_len)
    offset = int(rng.integers(0, content_len // 2))
    tail = np.resize(content[offset:], length - 1 - content_len)
    return np.concatenate([[COPY], content, tail]), 1 + content_len


def batch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Copy sequences, and labels only where the next token is predictable (the repeat)."""
    sequences = [copy_sequence(rng, SEQ_LEN) for _ in range(size)]
    ids = np.stack([seq for seq, _ in sequences])
    labels = ids.copy()
    for row, (_, repeat_start) in enumerate(sequences):
        # Random content and the repeat's first token (its offset is random): nothing to learn.
        labels[row, : repeat_start + 1] = -100
    return ids, labels


def train(out: Path, steps: int, batch_size: int = 32, seed: int = 0, threads: int = 1) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=COPY,
    )
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=steps, pct_start=0.1)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        ids, labels = (torch.from_numpy(a) for a in batch(rng, batch_size))
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    accuracy = copy_accuracy(model, np.random.default_rng(seed + 1))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    info = {"steps": steps, "train_seconds": round(time.perf_counter() - start, 1), "copy_accuracy": accuracy}
    (out / "training.json").write_text(json.dumps(info, indent=1))
    return info


def copy_accuracy(model: object, rng: np.random.Generator, num: int = 16) -> float:
    """Greedy next-token accuracy on the repeated part of fresh copy sequences (first token excluded)."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for _ in range(num):
            seq, repeat_start = copy_sequence(rng, SEQ_LEN)
            logits = model(input_ids=torch.from_numpy(seq[None])).logits[0]  # type: ignore[operator]
            predicted = logits.argmax(-1).numpy()[:-1]  # predicted[i] is the guess for seq[i + 1]
            repeat = np.arange(len(seq) - 1) >= repeat_start
            hits += int((predicted[repeat] == seq[1:][repeat]).sum())
            total += int(repeat.sum())
    return round(hits / total, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine may be shared)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(train(args.out, args.steps, args.batch_size, args.seed, args.threads)))


if __name__ == "__main__":
    main()
