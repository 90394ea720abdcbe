"""Where a single stream's decode time goes: one B=1 decode step in process (forward by part, and
sampling; evenflow/bench/roofline.py's split) against the same model's per-token time end to end
through the offline ``LLM`` (engine-core and worker processes, the step's trip between them, the
scheduler), so that the difference is the cost outside the worker's step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from evenflow.bench.roofline import StepSplit, profile_decode
from evenflow.protocol import WorkerConfig
from evenflow.worker.runner import ModelRunner


@dataclass(frozen=True)
class LatencyRow:
    mode: str
    in_process: StepSplit
    end_to_end_s: float  # per decoded token through LLM

    @property
    def outside_step_s(self) -> float:
        return max(self.end_to_end_s - self.in_process.total_s, 0.0)


def _engine_args(model: str, mode: str) -> dict[str, object]:
    args: dict[str, object] = {"dtype": "bfloat16" if mode == "bfloat16" else "float32"}
    if model.endswith(".gguf"):
        args["quantization"] = "gguf" if mode == "int4" else "none"
    return args


def runner_for(model: str, mode: str, context: int, threads: int) -> ModelRunner:
    """A runner for B=1 decode steps at ``context`` tokens, torch set to ``threads``."""
    torch.set_num_threads(threads)  # the runner sets its threads per step in execute_model, not called here
    return ModelRunner(WorkerConfig(model=model, device="cpu", block_size=16, max_model_len=context + 16,
                                    num_kv_blocks=context // 16 + 2, num_threads=threads, **_engine_args(model, mode)))


def in_process_split(model: str, mode: str, context: int, threads: int, steps: int) -> StepSplit:
    return profile_decode(runner_for(model, mode, context, threads), 1, context, steps)


def end_to_end_per_token(model: str, mode: str, prompt_len: int, tokens: int, threads: int) -> float:
    """Seconds per decoded token of one stream: (time of prompt + ``tokens``) - (time of prompt + 1),
    over ``tokens - 1``, greedy, through a fresh LLM (its engine-core and worker processes)."""
    from evenflow.frontend.llm import LLM, SamplingParams

    llm = LLM(model, worker_threads=threads, kv_cache_memory=64 << 20, max_model_len=prompt_len + tokens + 16,
              **_engine_args(model, mode))
    try:
        prompt = list(range(100, 100 + prompt_len))

        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t0

        run(2)  # warm-up
        short, full = min(run(1) for _ in range(2)), min(run(tokens) for _ in range(2))
        return (full - short) / (tokens - 1)
    finally:
        llm.shutdown()


def format_table(rows: list[LatencyRow]) -> str:
    # The parts are of the step with timing wrappers ("timed step": roofline.StepSplit)
    lines = ["| mode | step in process ms | timed step ms | linears | LM head | attention | sampling | rest | "
             "per token end to end ms | outside the step ms | tok/s |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        s = r.in_process
        lines.append(f"| {r.mode} | {s.total_s * 1e3:.1f} | {s.split_total_s * 1e3:.1f} | {s.linear_s * 1e3:.1f} | "
                     f"{s.head_s * 1e3:.1f} | "
                     f"{s.attention_s * 1e3:.1f} | {s.sampling_s * 1e3:.1f} | {s.rest_s * 1e3:.1f} | "
                     f"{r.end_to_end_s * 1e3:.1f} | "
                     f"{r.outside_step_s * 1e3:.1f} | {1 / r.end_to_end_s:.1f} |")
    return "\n".join(lines)
