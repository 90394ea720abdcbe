"""The worker's memory does not follow the shapes of its steps: a ModelRunner fed steps of many
token counts it has not seen keeps its RSS within a bound. oneDNN keeps a primitive per GEMM row
count (~0.6 MB for a SmolLM2 projection), and worker/models/row_tiles.py bounds the counts. The
model has SmolLM2-135M's projection shapes (576 wide, 1536 intermediate, 9/3 heads of 64), so
its GEMMs are the real model's, on 2 layers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from evenflow.bench.shape_memory import StepShape, rss_mb, run_steps, step_of
from evenflow.worker.models.linear import PackedCpuLinear
from evenflow.worker.models.row_tiles import EXACT_ROWS, bucket_rows
from tests.checkpoints import make_checkpoint
from tests.worker.harness import make_runner

MAX_MODEL_LEN, BLOCK, NUM_BLOCKS = 256, 16, 64
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
# 24 new token counts in (64, 128]: without row tiles each step makes oneDNN build 4 primitives
# (qkv, o, gate_up, down), +2.6 MB a step here (+63 MB for the 24, measured); with them, none.
NEW_SHAPES_GROWTH_BOUND_MB = 12.0


def test_runner_rss_stays_bounded_over_many_new_step_shapes(checkpoint_root: Path) -> None:
    if not PackedCpuLinear.works():
        pytest.skip("this torch has no oneDNN packed linear (the kernel whose cache this bounds)")
    runner = make_runner(make_checkpoint(checkpoint_root, **SMOLLM2_SHAPES), num_blocks=NUM_BLOCKS,
                         block_size=BLOCK, max_model_len=MAX_MODEL_LEN, num_threads=1)
    rng = random.Random(0)

    def steps(counts: list[int]) -> list[StepShape]:
        return [step_of(n, rng, MAX_MODEL_LEN, BLOCK, NUM_BLOCKS) for n in counts]

    counts = range(EXACT_ROWS + 1, 2 * EXACT_ROWS + 1)
    buckets = sorted({bucket_rows(n) for n in counts})
    new_counts = [n for n in counts if n not in buckets][:24]
    run_steps(runner, steps([1, 2, 3, 5, 8, *buckets]))  # every bucket once: what the tiles allow
    before = rss_mb()
    run_steps(runner, steps(new_counts))
    after_new = rss_mb()
    run_steps(runner, steps(new_counts[::-1]))  # the same counts again, in other step compositions
    after_again = rss_mb()
    assert after_new - before < NEW_SHAPES_GROWTH_BOUND_MB, (before, after_new)
    assert after_again - before < NEW_SHAPES_GROWTH_BOUND_MB, (before, after_new, after_again)
