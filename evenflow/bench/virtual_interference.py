"""The interference workload on a virtual clock: the real scheduler and budget controller, steps priced
by a cost model fitted to the real model runner's measured steps.

Served end to end, a benchmark on a machine shared with other heavy processes measures the other
processes (a real-model step at 10x its CPU time, because the process got a tenth of a core). Here
every step's cost comes from the model's own *CPU* time on one thread (``measure_costs``: a grid of
step shapes, each timed by ``time.thread_time``, fitted with the controller's features), so what is
compared is how each budget hands out the steps, the question the budget answers. Left out: the
frontend, the network, overlap of scheduling with the step, and the worker's thread plan (one
thread); a step's jitter is a lognormal factor (``JITTER_SIGMA``), seeded.

Workload (as ``sweep_budget.py --workload interference``): N steady streams (each restarts when it
finishes) and a long prompt every ``long_interval_s``; ITL of the streams' tokens, TTFT of the long
prompts, throughput over the run.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np

from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.sched.step_time_model import StepShape, shape_of_step
from evenflow.protocol import (CachedRequestData, ModelRunnerOutput, NewRequestData, SamplingParams,
                               SchedulerOutput, WorkerConfig)

JITTER_SIGMA = 0.05


@dataclass(frozen=True)
class MachineCosts:
    """Seconds = fixed + per_token * tokens + per_read * K/V reads + per_pair * pairs + per_request * requests."""

    coefficients: tuple[float, float, float, float, float]

    def seconds(self, shape: StepShape) -> float:
        x = (1.0, shape.tokens, shape.kv_reads, shape.prefill_pairs, shape.requests)
        return max(float(np.dot(self.coefficients, x)), 1e-4)


def measure_costs(model_dir: str, dtype: str = "float32", repeats: int = 2) -> MachineCosts:
    """Time a grid of step shapes on the model runner (one thread, CPU seconds) and fit the costs."""
    from evenflow.worker.runner import ModelRunner

    block = 16
    max_len = 4096
    runner = ModelRunner(WorkerConfig(model=model_dir, dtype=dtype, device="cpu", block_size=block,
                                      max_model_len=max_len, num_kv_blocks=40 * max_len // block, max_num_seqs=40,
                                      max_num_batched_tokens=2048, num_threads=1, attention_backend="torch"))
    runner.init_kv_cache(40 * max_len // block)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    step_ids = itertools.count()
    rows, seconds = [], []
    grid = [(d, cd, p, cp) for d, cd, p, cp in itertools.product((0, 8, 24), (256, 2048), (0, 64, 512), (0, 1536))
            if (d or p) and not (p == 0 and cp) and not (d == 0 and cd != 256)]
    for d, cd, p, cp in grid:
        reqs = [(f"d{i}", cd - 1, 1) for i in range(d)] + ([("p", cp, p)] if p else [])
        new, next_block = [], 1
        for req_id, computed, n in reqs:
            length = computed + n + (n > 1)
            blocks = list(range(next_block, next_block + -(-(length + 1) // block)))
            next_block += len(blocks)
            new.append(NewRequestData(req_id, [3 + (7 * j) % 200 for j in range(length)], params, blocks, computed))
        scheduled = {r: n for r, _, n in reqs}
        runner.execute_model(SchedulerOutput(next(step_ids), new, [], scheduled, sum(scheduled.values())))
        cached = [CachedRequestData(r, [], computed) for r, computed, _ in reqs]
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            runner.execute_model(SchedulerOutput(next(step_ids), [], cached, scheduled, sum(scheduled.values())))
            best = min(best, time.thread_time() - start)
        runner.execute_model(SchedulerOutput(next(step_ids), [], [], {}, 0, finished_req_ids=[r for r, _, _ in reqs]))
        shape = shape_of_step(d, d * (cd - 1), [(p, cp)] if p else [])
        rows.append([1.0, shape.tokens, shape.kv_reads, shape.prefill_pairs, shape.requests])
        seconds.append(best)
    x = np.array(rows)
    scale = 1.0 / np.maximum(np.abs(x).max(axis=0), 1e-12)
    theta, *_ = np.linalg.lstsq(x * scale, np.array(seconds), rcond=None)
    return MachineCosts(tuple(float(c) for c in np.maximum(theta * scale, 0.0)))  # type: ignore[arg-type]


@dataclass
class Workload:
    streams: int = 6
    stream_prompt_len: int = 128
    stream_output_len: int = 64
    long_prompt_len: int = 2048
    long_output_len: int = 16
    long_interval_s: float = 10.0
    long_first_s: float = 3.0
    duration_s: float = 84.0


@dataclass
class RunResult:
    label: str
    itl_ms: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    elapsed_s: float = 0.0
    target_ms: float = 0.0  # the controller's target, averaged over the steps of the arrival window
    mean_budget: float = 0.0
    tokens_per_step: float = 0.0
    engine_us_per_step: float = 0.0  # the scheduler's own time a step (schedule + update), this process's wall clock

    def summary(self) -> dict[str, float]:
        itl = np.array(self.itl_ms) if self.itl_ms else np.zeros(1)
        return dict(itl_p50=float(np.percentile(itl, 50)), itl_p99=float(np.percentile(itl, 99)),
                    itl_max=float(itl.max()), gaps_over_250=float((itl > 250).sum()),
                    ttft_p50=float(np.median(self.long_ttft_s)) if self.long_ttft_s else float("nan"),
                    ttft_p99=float(np.percentile(self.long_ttft_s, 99)) if self.long_ttft_s else float("nan"),
                    out_tok_s=self.output_tokens / max(self.elapsed_s, 1e-9))


def run(label: str, config: SchedulerConfig, costs: MachineCosts, load: Workload, seed: int = 0) -> RunResult:
    """The workload against one scheduler configuration, on the virtual clock."""
    scheduler = Scheduler(config)
    rng = random.Random(seed)
    prompt_rng = random.Random(seed + 1)
    ids = itertools.count()
    now = 0.0
    last_token: dict[str, float] = {}
    arrival: dict[str, float] = {}
    result = RunResult(label)
    targets: list[float] = []

    def add(kind: str, prompt_len: int, output_len: int) -> None:
        req_id = f"{kind}-{next(ids)}"
        prompt = [prompt_rng.randrange(4, 8000) for _ in range(prompt_len)]
        scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)))
        arrival[req_id] = now

    for _ in range(load.streams):
        add("stream", load.stream_prompt_len, load.stream_output_len)
    next_long = load.long_first_s
    while now < load.duration_s or scheduler.has_unfinished_requests():
        if now >= next_long and now < load.duration_s:
            add("long", load.long_prompt_len, load.long_output_len)
            next_long += load.long_interval_s
        if not scheduler.has_unfinished_requests():
            now = next_long
            continue
        output = scheduler.schedule()
        if scheduler.budget_controller is not None and now < load.duration_s:
            targets.append(scheduler.budget_controller.target_s)
        computed = {c.req_id: c.num_computed_tokens for c in output.scheduled_cached_reqs}
        computed.update((n.req_id, n.num_computed_tokens) for n in output.scheduled_new_reqs)
        decodes = [r for r, n in output.num_scheduled_tokens.items() if n == 1]
        chunks = [(n, computed[r]) for r, n in output.num_scheduled_tokens.items() if n > 1]
        shape = shape_of_step(len(decodes), sum(computed[r] for r in decodes), chunks)
        seconds = costs.seconds(shape) * rng.lognormvariate(0.0, JITTER_SIGMA)
        now += seconds
        req_ids = list(output.num_scheduled_tokens)
        sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
        outputs = scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, req_ids, sampled,
                                                                         forward_s=seconds))
        for out in outputs:
            r = out.request_id
            result.output_tokens += len(out.new_token_ids)
            if r.startswith("stream") and r in last_token:
                result.itl_ms.append(1e3 * (now - last_token[r]))
            if r.startswith("long") and r not in last_token:
                result.long_ttft_s.append(now - arrival[r])
            last_token[r] = now
            if out.finish_reason is not None and r.startswith("stream") and now < load.duration_s:
                add("stream", load.stream_prompt_len, load.stream_output_len)
    result.elapsed_s = now
    stats = scheduler.get_stats()
    result.target_ms = 1e3 * float(np.mean(targets)) if targets else 0.0
    steps = sum(stats.budget.token_budget_log2_counts)
    result.mean_budget = stats.budget.token_budget_sum / steps if steps else 0.0
    result.tokens_per_step = stats.scheduler.num_scheduled_tokens / max(stats.scheduler.num_steps, 1)
    counts = stats.scheduler
    result.engine_us_per_step = 1e6 * (counts.schedule_s + counts.update_s) / max(counts.num_steps, 1)
    return result
