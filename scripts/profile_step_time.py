"""How well does the adaptive budget's step-time model fit this machine? Time the real model runner
on a grid of step shapes and fit the controller's features to them.

Each shape is D decodes at context Cd (one new token each) plus at most one prefill chunk of P
tokens after Cp computed ones: the mixed steps ``--target-itl-ms`` plans. Each shape runs
``--repeats`` times after a warm-up; the median of prepare + forward + sample is kept. Then the
``StepTimeModel`` features are fitted by least squares (the same linear model the engine fits
online) and the table shows, per shape group, the measured time and the model's error, plus the
error in the *chunk's own* cost (shape minus the same decodes without the chunk): the quantity the
controller's allowance depends on.

    python scripts/profile_step_time.py --model-dir /tmp/tiny [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from evenflow.core.sched.step_time_model import StepShape, StepTimeModel, chunk_pairs, shape_of_step
from evenflow.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, WorkerConfig
from evenflow.worker.runner import ModelRunner


@dataclass(frozen=True)
class Shape:
    decodes: int
    decode_context: int
    chunk: int
    chunk_context: int

    def step_shape(self) -> StepShape:
        chunks = [(self.chunk, self.chunk_context)] if self.chunk else []
        return shape_of_step(self.decodes, self.decodes * (self.decode_context - 1), chunks)

    def one_attention_term(self) -> np.ndarray:
        """The features of a model with one attention term, all (query, key) pairs at one price
        (what the controller fitted before it told K/V reads from prefill pairs)."""
        pairs = self.decodes * self.decode_context + chunk_pairs(self.chunk, self.chunk_context)
        return np.array([1.0, self.decodes + self.chunk, pairs, self.decodes + (self.chunk > 0)])


class StepTimer:
    """Adds a shape's requests in one untimed step, then replays the same step and times it."""

    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner, self.block_size = runner, block_size
        self.step_id = 0
        self.next_block = 1
        self.params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return blocks

    def _step(self, scheduled: dict[str, int], new: list[NewRequestData], cached: list[CachedRequestData],
              finished: list[str]) -> float:
        out = self.runner.execute_model(SchedulerOutput(self.step_id, new, cached, scheduled, sum(scheduled.values()),
                                                        finished_req_ids=finished))
        self.step_id += 1
        return out.prepare_s + out.forward_s + out.sample_s

    def time(self, shape: Shape, repeats: int) -> float:
        self.next_block = 1
        reqs: list[tuple[str, int, int]] = []  # id, computed, scheduled
        for i in range(shape.decodes):
            reqs.append((f"d{self.step_id}.{i}", shape.decode_context - 1, 1))
        if shape.chunk:
            reqs.append((f"p{self.step_id}", shape.chunk_context, shape.chunk))
        new = []
        for req_id, computed, scheduled in reqs:
            # A chunk's prompt goes one token past it, so the chunk never samples (as mid-prefill).
            length = computed + scheduled + (scheduled > 1)
            prompt = [3 + (7 * j) % 250 for j in range(length)]
            new.append(NewRequestData(req_id, prompt, self.params, self._blocks(length + 1), computed))
        scheduled = {r: n for r, _, n in reqs}
        self._step(scheduled, new, [], [])
        cached = [CachedRequestData(r, [], computed) for r, computed, _ in reqs]
        times = [self._step(scheduled, [], cached, []) for _ in range(repeats)]
        self._step({}, [], [], [r for r, _, _ in reqs])
        return statistics.median(times)


def fit(features: Callable[[Shape], np.ndarray], shapes: list[Shape], seconds: dict[Shape, float]
        ) -> Callable[[Shape], float]:
    """Least squares over ``features`` (what RLS converges to on these steps, without forgetting)."""
    x = np.stack([features(s) for s in shapes])
    scale = 1.0 / np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of O(1), as the engine scales them
    theta, *_ = np.linalg.lstsq(x * scale, np.array([seconds[s] for s in shapes]), rcond=None)
    return lambda s: float((theta * scale) @ features(s))


def chunk_cost(predict: Callable[[Shape], float], s: Shape) -> float:
    """A shape's time minus the same decodes' without the chunk (what the allowance rests on)."""
    return predict(s) - predict(Shape(s.decodes, s.decode_context, 0, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="fix the worker's thread count (0: the engine's plan: a long step on every core, a short one "
                         "leaving a core free, which makes time jump where a step turns long)")
    ap.add_argument("--decodes", default="0,8,32")
    ap.add_argument("--decode-contexts", default="128,1024,2048")
    ap.add_argument("--chunks", default="0,16,64,256")
    ap.add_argument("--chunk-contexts", default="0,512,1536")
    args = ap.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    block_size = 16
    longest = max(max(ints(args.decode_contexts)), max(ints(args.chunk_contexts)) + max(ints(args.chunks)) + 1)
    max_len = -(-(longest + 1) // block_size) * block_size  # room for every shape's prompt and its one new token
    # A chunk of 0 has no context: every decodes-alone shape is listed once, whatever --chunk-contexts
    # holds, as each chunk's own cost is measured against it.
    grid = list(dict.fromkeys(Shape(d, cd, p, cp if p else 0) for d, cd, p, cp in itertools.product(
        ints(args.decodes), ints(args.decode_contexts), ints(args.chunks), ints(args.chunk_contexts))
        if (d or p) and not (d == 0 and cd != ints(args.decode_contexts)[0])))
    max_decodes = max(ints(args.decodes))
    num_blocks = (max_decodes + 2) * (max_len // block_size)
    runner = ModelRunner(WorkerConfig(model=args.model_dir, dtype=args.dtype, device="cpu", block_size=block_size,
                                      max_model_len=max_len, num_kv_blocks=num_blocks, max_num_seqs=max_decodes + 1,
                                      max_num_batched_tokens=max_decodes + max(ints(args.chunks)),
                                      num_threads=args.threads or None))
    runner.init_kv_cache(num_blocks)
    timer = StepTimer(runner, block_size)
    for shape in grid[:3]:
        timer.time(shape, 2)  # warm-up
    seconds = {s: timer.time(s, args.repeats) for s in grid}
    model = StepTimeModel(max_tokens=max_decodes + max(ints(args.chunks)), max_model_len=max_len,
                          max_requests=max_decodes + 1)
    shapes = list(seconds)
    engine = fit(lambda s: model.features(s.step_shape()), shapes, seconds)
    one_term = fit(Shape.one_attention_term, shapes, seconds)
    measured = seconds.__getitem__
    print(f"{'D':>3} {'Cd':>5} {'P':>4} {'Cp':>5} | {'step ms':>7} {'model':>7} {'err%':>6} | "
          f"{'chunk ms':>8} {'model':>7} {'err%':>6} | {'1-term':>7} {'err%':>6}")
    step_errors: list[float] = []
    chunk_errors: dict[str, list[float]] = {"model": [], "one term": []}
    pct = lambda pred, true: 100 * (pred - true) / max(true, 1e-6)  # noqa: E731
    for s in shapes:
        ms, pred = measured(s) * 1e3, engine(s) * 1e3
        step_errors.append(abs(pct(pred, ms)))
        line = f"{s.decodes:>3} {s.decode_context:>5} {s.chunk:>4} {s.chunk_context:>5} | {ms:7.2f} {pred:7.2f} {pct(pred, ms):+6.1f} |"
        if s.chunk and s.decodes:
            true = chunk_cost(measured, s) * 1e3
            ours, theirs = chunk_cost(engine, s) * 1e3, chunk_cost(one_term, s) * 1e3
            chunk_errors["model"].append(abs(pct(ours, true)))
            chunk_errors["one term"].append(abs(pct(theirs, true)))
            line += f" {true:8.2f} {ours:7.2f} {pct(ours, true):+6.1f} | {theirs:7.2f} {pct(theirs, true):+6.1f}"
        print(line)
    print(f"median |error| of a step: {statistics.median(step_errors):.1f}%; of a chunk's own cost (mixed shapes): "
          f"the engine's model {statistics.median(chunk_errors['model']):.1f}%, one attention term "
          f"{statistics.median(chunk_errors['one term']):.1f}%")


if __name__ == "__main__":
    main()
