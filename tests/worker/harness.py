"""Drive a ModelRunner through the engine's own step loop, in-process, with or without overlap."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from evenflow.core.engine_loop import EngineLoop
from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.sched.structured_output import StructuredOutputManager
from evenflow.protocol import AdapterRef, ModelRunnerOutput, PromptLogprobs, SamplingParams, SchedulerOutput, WorkerConfig
from evenflow.worker.in_process import InProcessExecutor
from evenflow.worker.runner import ModelRunner


@dataclass
class Job:
    """A request to submit at ``arrive_step`` (the step counter of the loop)."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrive_step: int = 0
    params: SamplingParams | None = None
    eos_token_ids: tuple[int, ...] = ()  # as the engine passes the model's; () never stops on EOS
    lora: AdapterRef | None = None  # its LoRA adapter (the scheduler needs max_loras in scheduler_overrides)


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    steps: list[SchedulerOutput] = field(default_factory=list)  # every step the loop sent, in order
    num_draft_tokens: int = 0  # drafts the worker verified
    logprobs: dict[str, list] = field(default_factory=dict)  # TokenLogprobs per token, when asked
    num_accepted_drafts: int = 0
    runner_outputs: list[ModelRunnerOutput] = field(default_factory=list)  # in step order
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # when asked

    @property
    def num_preemptions(self) -> int:
        return sum(len(s.preempted_req_ids) for s in self.steps)

    @property
    def mixed_steps(self) -> int:
        """Steps where one request decoded while another prefilled a chunk of > 1 token."""
        return sum(1 for s in self.steps if 1 in s.num_scheduled_tokens.values()
                   and any(n > 1 for n in s.num_scheduled_tokens.values()))


class RecordingExecutor(InProcessExecutor):
    """The in-process executor, keeping every step it was sent and every output it gave back."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner=runner)
        self.steps: list[SchedulerOutput] = []
        self.runner_outputs: list[ModelRunnerOutput] = []

    def send_step(self, so: SchedulerOutput) -> None:
        self.steps.append(so)
        super().send_step(so)

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        out = super().recv_output(step_id)
        self.runner_outputs.append(out)
        return out


def make_runner(model_dir: Path, num_blocks: int = 256, block_size: int = 8, max_model_len: int = 512,
                **overrides: object) -> ModelRunner:
    cfg = WorkerConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=block_size,
                       max_model_len=max_model_len, num_kv_blocks=num_blocks, **overrides)
    runner = ModelRunner(cfg)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    return runner


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_jobs(runner: ModelRunner, jobs: list[Job], num_blocks: int, budget: int = 2048, overlap: bool = False,
             enable_prefix_caching: bool = True, max_steps: int = 2000,
             max_model_len: int | None = None, scheduler_overrides: dict[str, object] | None = None,
             structured_output: StructuredOutputManager | None = None) -> RunResult:
    """Run ``jobs`` to completion through an ``EngineLoop``; ``overlap``: its async scheduling
    (step N+1 is scheduled and sent before N's output applies). ``arrive_step`` counts loop steps.

    The runner's cache is reallocated to ``num_blocks`` so that it matches the scheduler's pool.
    ``scheduler_overrides`` sets any other SchedulerConfig field (max_num_seqs, policy, ...).
    ``structured_output`` serves jobs whose params carry a grammar; each grammar is compiled
    before its request's first step, so the steps do not depend on compile time.
    """
    runner.init_kv_cache(num_blocks)
    # Rows keep a previous run's block ids past their live blocks (read, then masked, by padded
    # attention); a smaller cache than that run's would make them out of range.
    runner.batch.block_table[:] = 0
    sched = Scheduler(SchedulerConfig(num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len or runner.config.max_model_len,
                                      block_size=runner.block_size,
                                      enable_prefix_caching=enable_prefix_caching,
                                      speculative_config=runner.config.speculative_config,
                                      **(scheduler_overrides or {})),  # type: ignore[arg-type]
                      structured_output)
    executor = RecordingExecutor(runner)
    loop = EngineLoop(sched, executor, async_scheduling=overlap)
    result = RunResult({j.req_id: [] for j in jobs})
    pending = sorted(jobs, key=lambda j: j.arrive_step)
    for step in range(max_steps):
        while pending and pending[0].arrive_step <= step:
            j = pending.pop(0)
            request = Request(j.req_id, j.prompt, j.params or greedy(j.max_tokens), j.eos_token_ids)
            request.set_lora(j.lora)
            sched.add_request(request)
            if request.grammar is not None:
                request.grammar.compiled.result(timeout=60)
        if not loop.has_work() and not pending:
            break
        for out in loop.step().outputs or ():
            result.outputs[out.request_id].extend(out.new_token_ids)
            if out.logprobs is not None:
                result.logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert out.request_id not in result.prompt_logprobs  # sent once, on the first output
                result.prompt_logprobs[out.request_id] = out.prompt_logprobs
    else:
        raise AssertionError(f"jobs did not finish in {max_steps} steps")
    result.steps, result.runner_outputs = list(executor.steps), list(executor.runner_outputs)
    loop.send_finished()  # so that the runner's batch empties before its next run
    for so, mro in zip(result.steps, result.runner_outputs):
        assert mro.step_id == so.step_id
        if mro.num_draft_tokens is not None:
            verified = [(d, len(t)) for d, t in zip(mro.num_draft_tokens, mro.sampled_token_ids) if d]
            result.num_draft_tokens += sum(d for d, _ in verified)
            result.num_accepted_drafts += sum(n - 1 for _, n in verified)
    return result
