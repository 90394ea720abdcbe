"""How the start-up measurements time a kernel: the min over interleaved trials, on every usable core, its
weights read from memory as a step reads them (models/int4_linear.py's plan, models/lm_head.py's screen)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from evenflow.worker.models.q4_blocks import Int4Weight
from evenflow.worker.threads import usable_cores

TRIALS = 5  # min over interleaved trials: the machine may be shared, a min is the stable figure
# The copies a probe cycles through add up to this, so each product reads its weight from memory, as a
# step does, not from a cache the previous trial filled.
COPY_PROBE_BYTES = 96 << 20
INT4_RUN = 8  # 4-bit products timed in a row, as a step's projections follow each other


def time_min(fns: list, trials: int = TRIALS) -> list[float]:
    """Seconds per call of each function: min over trials, the functions interleaved in each."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(trials):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


@contextmanager
def on_every_core() -> Iterator[None]:
    """torch on every usable core for a start-up measurement: a step of more than a few rows on a real
    model is a long step (evenflow/worker/threads.py), and the kernels scale differently with threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def int4_from_memory(weight: Int4Weight) -> Callable[[Callable[[Int4Weight], object]], None]:
    """``run(product)``: ``INT4_RUN`` 4-bit products in a row, as a decode step's projections follow each other,
    each with the next of enough copies of ``weight`` (``COPY_PROBE_BYTES``) that it reads its weight from
    memory. Timed alone on one weight the cache kept, torch's kernel beat the GEMV at one row where, read from
    memory product after product, the GEMV took 0.54-0.84x its time."""
    count = -(-COPY_PROBE_BYTES // weight.nbytes) + INT4_RUN
    strip = weight.strip_scales
    copies = [replace(weight, packed=weight.packed.clone(), scale_zeros=weight.scale_zeros.clone(),
                      strip_scales=None if strip is None else strip.clone()) for _ in range(count)]
    turn = [0]

    def run(product: Callable[[Int4Weight], object]) -> None:
        start = turn[0]
        turn[0] = (start + INT4_RUN) % (count - INT4_RUN)
        for w in copies[start:start + INT4_RUN]:
            product(w)

    return run
