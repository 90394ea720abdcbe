"""Teacher-forced scoring of a token sequence through a ModelRunner's model, in chunks of a given
size: chunks of 1 row take the int4 kernel, long chunks the dequantized dense path."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from evenflow.worker.runner import ModelRunner
from evenflow.worker.synthetic_steps import synthetic_step


@dataclass(frozen=True)
class Scored:
    logits: torch.Tensor  # float32 [len(tokens) - 1, vocab]: the prediction of tokens[1:]
    nll: torch.Tensor  # float32 [len(tokens) - 1]

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))


def score(runner: ModelRunner, tokens: list[int], chunk: int, greedy: bool = False) -> Scored:
    """Logits at every position of ``tokens`` computed ``chunk`` positions per forward; ``greedy``: as a
    plain greedy step asks them (only each row's argmax is float32's)."""
    model, caches = runner.model, runner.kv_caches
    parts = []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            ids = tokens[start : start + chunk]
            step = synthetic_step([len(ids)], [start + len(ids)], runner.block_size, runner.device)
            logits = model(torch.tensor(ids), step.positions, caches, runner.attn, runner.attn.plan(step.attn),
                           torch.arange(len(ids)), greedy=greedy)
            parts.append(logits.float())
    logits = torch.cat(parts)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="none")
    return Scored(logits, nll)
