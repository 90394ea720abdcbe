"""Time the engine's step loop (schedule, send, apply) per step, with no model at all.

Workloads: N requests all decoding (N = 64, 256, 1024), and a mixed one where long prompts with a
shared system prefix arrive while requests decode, so steps mix chunked prefills, prefix-cache
hits and decodes; and the mixed one again with the adaptive budget on (``--target-itl-ms``), its
step times made up by a linear function of the step's tokens and requests so the controller
fits and chooses as it would in the engine. The steps run through the engine's ``EngineLoop``
(overlap off) with a made-up executor whose own time is taken out of each step's: what is timed is
the scheduler and the loop. "us/request" is the median over steps of
(step time / requests in the step). On a shared machine, look at min and median: p99 mostly
measures other processes taking the CPU.

    python scripts/bench_scheduler.py [--steps 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from collections import deque

from evenflow.core.engine_loop import EngineLoop
from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.prefill_gate import PrefillGate
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput, WorkerReady


@dataclass
class StepTimes:
    name: str
    step_us: list[float]
    requests_per_step: list[int]

    def row(self) -> str:
        ordered = sorted(self.step_us)
        median = statistics.median(ordered)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        per_request = statistics.median(t / max(n, 1) for t, n in zip(self.step_us, self.requests_per_step))
        mean_reqs = statistics.mean(self.requests_per_step)
        return (
            f"| {self.name:<34} | {mean_reqs:9.1f} | {ordered[0]:11.1f} | {median:14.1f} | {p99:11.1f} "
            f"| {per_request:10.2f} |"
        )


class MadeUpExecutor:
    """What a model would return: one token for every request whose chunk reached its end, and a
    step time for the adaptive budget to fit (2 ms + 20 us per token + 50 us per request).
    ``spent_s`` counts its own time, which the benchmark takes out of the loop's."""

    def __init__(self, scheduler: Scheduler, rng: random.Random) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.spent_s = 0.0
        self.last: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self._outputs: deque[ModelRunnerOutput] = deque()

    def start(self) -> list[WorkerReady]:
        config = self.scheduler.config
        return [WorkerReady(0, config.num_kv_blocks, config.block_size, "none", "none", "none")]

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def send_step(self, so: SchedulerOutput) -> None:
        start = time.perf_counter()
        req_ids = list(so.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[self.rng.randrange(1, 32000)] if requests[r].num_output_placeholders else [] for r in req_ids]
        seconds = 2e-3 + 20e-6 * so.total_num_scheduled_tokens + 50e-6 * len(req_ids)
        mro = ModelRunnerOutput(so.step_id, req_ids, sampled, forward_s=seconds)
        self.last = (so, mro)
        self._outputs.append(mro)
        self.spent_s += time.perf_counter() - start

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        return self._outputs.popleft()

    def check_alive(self) -> None:
        pass

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def loop_for(scheduler: Scheduler, rng: random.Random) -> EngineLoop:
    """The engine's loop, overlap off; the made-up tokens come from the workload's ``rng``."""
    return EngineLoop(scheduler, MadeUpExecutor(scheduler, rng), async_scheduling=False)


def timed_step(loop: EngineLoop) -> tuple[float, int]:
    """One loop step's microseconds, less the executor's, and the requests it ran."""
    executor = loop.executor
    assert isinstance(executor, MadeUpExecutor)
    spent = executor.spent_s
    start = time.perf_counter()
    loop.step()
    elapsed = time.perf_counter() - start - (executor.spent_s - spent)
    assert executor.last is not None
    return elapsed * 1e6, len(executor.last[0].num_scheduled_tokens)


def bench_decodes(num_requests: int, num_steps: int) -> StepTimes:
    rng = random.Random(0)
    config = SchedulerConfig(
        num_kv_blocks=num_requests * 64,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(2048, num_requests),
        max_model_len=4096,
    )
    scheduler = Scheduler(config)
    loop = loop_for(scheduler, rng)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(128)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=100_000, ignore_eos=True)))
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):  # prefill everybody
        timed_step(loop)
    times, counts = zip(*(timed_step(loop) for _ in range(num_steps)))
    return StepTimes(f"{num_requests} decodes", list(times), list(counts))


def bench_mixed(num_steps: int, target_itl_ms: float | None = None) -> StepTimes:
    """128 decoders; a new 1-3k-token prompt (1k shared system prefix) every other step."""
    rng = random.Random(1)
    config = SchedulerConfig(num_kv_blocks=40_000, max_model_len=8192, target_itl_ms=target_itl_ms)
    scheduler = Scheduler(config)
    loop = loop_for(scheduler, rng)
    system_prompt = [rng.randrange(1, 32000) for _ in range(1024)]
    next_id = 0

    def arrive(prompt_len: int, max_tokens: int) -> None:
        nonlocal next_id
        prompt = system_prompt + [rng.randrange(1, 32000) for _ in range(prompt_len - len(system_prompt))]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(f"m{next_id}", prompt, params))
        next_id += 1

    for _ in range(128):
        arrive(1100, rng.randrange(200, 2000))
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        timed_step(loop)
    times, counts = [], []
    for step in range(num_steps):
        if step % 2 == 0:
            arrive(rng.randrange(1100, 3000), rng.randrange(50, 500))
        elapsed, count = timed_step(loop)
        times.append(elapsed)
        counts.append(count)
    stats = scheduler.get_stats()
    hit_rate = stats.kv_cache.prefix_cache_hits / max(stats.kv_cache.prefix_cache_queries, 1)
    name = f"mixed: prefill chunks, {hit_rate:.0%} hits"
    if target_itl_ms is not None:
        name = f"mixed, --target-itl-ms {target_itl_ms:g}"
    return StepTimes(name, times, counts)


def bench_controller_cost(num_steps: int, num_requests: int, target_itl_ms: float) -> StepTimes:
    """The adaptive budget's own work per step, alone: survey the running requests, choose the
    allowance, record the step and fit its time (what ``--target-itl-ms`` adds to a step)."""
    rng = random.Random(2)
    config = SchedulerConfig(num_kv_blocks=num_requests * 64, max_num_seqs=num_requests,
                             max_num_batched_tokens=max(2048, num_requests), max_model_len=4096,
                             target_itl_ms=target_itl_ms)
    scheduler = Scheduler(config)
    loop = loop_for(scheduler, rng)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(128)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=100_000, ignore_eos=True)))
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        timed_step(loop)
    controller = scheduler.budget_controller
    assert controller is not None
    executor = loop.executor
    assert isinstance(executor, MadeUpExecutor)
    times = []
    for _ in range(num_steps):
        loop.step()
        assert executor.last is not None
        output, mro = executor.last
        # Once more, alone: what the step above spent surveying, choosing, recording and fitting.
        start = time.perf_counter()
        gate = PrefillGate.for_step(config, 0, scheduler.running, 1, controller.prefill_allowance)
        controller.record(output, gate)
        controller.observe(output, mro)
        times.append((time.perf_counter() - start) * 1e6)
    return StepTimes(f"controller alone, {num_requests} running", times, [num_requests] * num_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="timed steps per workload")
    parser.add_argument("--target-itl-ms", type=float, default=20.0, help="target of the adaptive-budget row")
    args = parser.parse_args()
    results = [bench_decodes(n, args.steps) for n in (64, 256, 1024)] + [bench_mixed(args.steps)]
    results.append(bench_mixed(args.steps, target_itl_ms=args.target_itl_ms))
    results += [bench_controller_cost(args.steps, n, args.target_itl_ms) for n in (64, 256, 1024)]
    print(
        "| workload                           | reqs/step | min us/step | median us/step | p99 us/step | us/request |"
    )
    print(
        "|------------------------------------|----------:|------------:|---------------:|------------:|-----------:|"
    )
    for result in results:
        print(result.row())


if __name__ == "__main__":
    main()
