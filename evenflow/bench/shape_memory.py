"""Worker memory against step shapes: run a ModelRunner's forward on steps of distinct token
counts and read the process's RSS, to tell memory that follows shapes (kernel caches) from memory
that follows load. Used by scripts/probe_shape_memory.py and tests/real/test_shape_memory.py.
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass

import psutil
import torch

from evenflow.worker.runner import ModelRunner
from evenflow.worker.synthetic_steps import synthetic_step


@dataclass(frozen=True)
class StepShape:
    """One step: request i computes its last ``q_lens[i]`` of ``ctx_lens[i]`` positions (decodes first)."""

    q_lens: list[int]
    ctx_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def step_of(num_tokens: int, rng: random.Random, max_model_len: int, block_size: int, num_blocks: int) -> StepShape:
    """A step of exactly ``num_tokens`` tokens: a few decodes, the rest one or two prefill
    chunks, contexts random but within ``num_blocks`` blocks of the synthetic block table."""
    decodes = rng.randrange(0, min(num_tokens, 4) + 1)
    rest = num_tokens - decodes
    if rest == 1:
        decodes, rest = decodes + 1, 0
    chunks = [rest] if rest < 4 or rng.random() < 0.5 else [rest // 2, rest - rest // 2]
    chunks = [c for c in chunks if c]
    num_reqs = decodes + len(chunks)
    # synthetic_step gives every request the blocks of the longest context: keep that within the cache.
    max_ctx = min(max_model_len, num_blocks // num_reqs * block_size)
    if max(chunks, default=1) > max_ctx:
        raise ValueError(f"a {num_tokens}-token step does not fit {num_blocks} blocks of {block_size}")
    q_lens = [1] * decodes + chunks
    ctx_lens = [rng.randrange(q, max_ctx + 1) for q in q_lens]
    return StepShape(q_lens, ctx_lens)


def run_steps(runner: ModelRunner, steps: list[StepShape]) -> None:
    """Each step's forward (attention plan, every layer, the LM head) on the runner's KV cache."""
    for s in steps:
        step = synthetic_step(s.q_lens, s.ctx_lens, runner.block_size, runner.device)
        with torch.inference_mode():
            runner._run_synthetic(step, runner.kv_caches)


def rss_mb() -> float:
    """This process's resident memory after returning freed heap to the system (so what is left
    is held, not merely not yet trimmed)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it stands
        pass
    return psutil.Process().memory_info().rss / 2**20
