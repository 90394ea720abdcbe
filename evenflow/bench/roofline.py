"""A decode step against the memory roofline: the bytes it must read, the machine's read bandwidth,
and where the step's time goes (linears / attention / sampling / the rest).

A decode step of B sequences reads every projection weight once, the LM head once, B embedding
rows, and each sequence's K and V over its context in every layer; at the measured read bandwidth
that is the step's floor (``roofline_s``). The step's time is taken as it is served; its split by timing
wrappers around the model's linear kernel, its attention backend and the sampler in a step run beside it
(CPU calls are synchronous, so a wall-clock wrapper measures the call). A wrapped kernel turns off the
layer glue and the fused layer loop (models/fused_decode.py), whose calls bypass the wrappers: that step
runs the Python layer loop, and its parts are of that loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from evenflow.protocol import WorkerConfig
from evenflow.worker.models.int4_linear import Int4CpuLinear
from evenflow.worker.models.q4_blocks import Int4Weight
from evenflow.worker.runner import ModelRunner
from evenflow.worker.sampling_metadata import SamplingMetadata
from evenflow.worker.synthetic_steps import synthetic_step


@dataclass(frozen=True)
class StepSplit:
    """Seconds of one decode step as served (median over the timed steps), and by part in a step with
    timing wrappers (its own total ``split_total_s``: the Python layer loop, see the module docstring)."""

    total_s: float
    linear_s: float  # the projections (the model's linear kernel), not the LM head
    attention_s: float
    sampling_s: float
    head_s: float  # the LM head
    split_total_s: float

    @property
    def rest_s(self) -> float:
        """The wrapped step's time outside its parts (the interpreter between them, the elementwise ops)."""
        return max(self.split_total_s - self.linear_s - self.attention_s - self.sampling_s - self.head_s, 0.0)


@dataclass(frozen=True)
class RooflineRow:
    model: str
    mode: str  # float32, bfloat16, int4
    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    bandwidth: float  # bytes/s
    split: StepSplit

    @property
    def roofline_s(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth

    @property
    def ratio(self) -> float:
        """Step time over its roofline (1.0: bound by memory reads alone)."""
        return self.split.total_s / self.roofline_s


def read_bandwidth(nbytes: int = 256 << 20, trials: int = 7, clock=time.perf_counter) -> float:
    """Bytes/s of a full read of a buffer far larger than the caches (a float32 sum), best of ``trials``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(trials):
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return nbytes / best


def _nbytes(weight: torch.Tensor | Int4Weight, linear: object = None, rows: int = 1) -> int:
    if isinstance(weight, Int4Weight):
        return linear.step_nbytes(weight, rows) if isinstance(linear, Int4CpuLinear) else weight.nbytes
    return weight.numel() * weight.element_size()


def decode_step_bytes(runner: ModelRunner, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one greedy decode step of ``batch`` sequences at ``context`` tokens reads."""
    model = runner.model
    weights = sum(_nbytes(getattr(w, name), model.linear, batch) for w in model._linears
                  for name in ("qkv", "o", "gate_up", "down"))
    weights += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("norm"))
    head = model._screened_head
    weights += _nbytes(model._head) if head is None else head.step_nbytes(batch, greedy=True)
    weights += batch * model.embed.shape[1] * model.embed.element_size()
    kv_elem = torch.empty(0, dtype=runner.kv_dtype).element_size()
    kv = 2 * model.cfg.num_layers * batch * context * model.num_kv_heads * model.cfg.head_dim * kv_elem
    return weights, kv


class _Timed:
    """Wraps a callable; sums the seconds of its calls."""

    def __init__(self, fn, clock=time.perf_counter) -> None:
        self.fn, self.seconds, self.clock = fn, 0.0, clock

    def __getattr__(self, name: str):  # the rest of the wrapped kernel's interface (act_dtype, plan)
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        t0 = self.clock()
        out = self.fn(*args, **kwargs)
        self.seconds += self.clock() - t0
        return out


class _TimedAttention:
    def __init__(self, backend, clock) -> None:
        self.backend = backend
        self.forward = _Timed(backend.forward, clock)

    def plan(self, inputs):
        return self.backend.plan(inputs)


def profile_decode(runner: ModelRunner, batch: int, context: int, steps: int = 20,
                   clock=time.perf_counter) -> StepSplit:
    """Median split of ``steps`` synthetic decode steps (``batch`` sequences at ``context`` tokens,
    greedy sampling), after two warm-up steps."""
    step = synthetic_step([1] * batch, [context] * batch, runner.block_size, runner.device)
    caches = runner._scratch_caches(step.num_blocks)
    model = runner.model
    meta = SamplingMetadata(num_reqs=batch, vocab_size=runner.vocab_size)
    kernel, head_kernel, screened = model.linear, model.head_linear, model._screened_head
    served: list[float] = []
    parts: list[tuple[float, float, float, float, float]] = []  # wrapped: total, linears, attention, sampling, head

    def one_step(attn: object, sampler: object) -> float:
        t0 = clock()
        logits = model(step.input_ids, step.positions, caches, attn, attn.plan(step.attn), step.logits_indices,
                       greedy=True)
        sampler(logits, meta).sampled_token_ids.tolist()
        return clock() - t0

    try:
        with torch.inference_mode():
            for i in range(steps + 2):
                total = one_step(runner.attn, runner.sampler)
                linear, attn, sampler = _Timed(kernel, clock), _TimedAttention(runner.attn, clock), _Timed(
                    runner.sampler, clock)
                head = _Timed(head_kernel if screened is None else screened, clock)
                model.linear = linear
                model.head_linear, model._screened_head = (head, None) if screened is None else (head_kernel, head)
                split_total = one_step(attn, sampler)
                model.linear, model.head_linear, model._screened_head = kernel, head_kernel, screened
                if i >= 2:
                    served.append(total)
                    parts.append((split_total, linear.seconds, attn.forward.seconds, sampler.seconds, head.seconds))
    finally:
        model.linear, model.head_linear, model._screened_head = kernel, head_kernel, screened
    split_total, linear_s, attention_s, sampling_s, head_s = sorted(parts)[len(parts) // 2]
    return StepSplit(sorted(served)[len(served) // 2], linear_s, attention_s, sampling_s, head_s, split_total)


def roofline_rows(model: str, mode: str, batch: int, context: int, threads: int, steps: int = 20,
                  clock=time.perf_counter, rounds: int = 1) -> list[RooflineRow]:
    """Load ``model`` in ``mode`` (float32 / bfloat16 / int4) and measure its row of the table ``rounds`` times,
    each round the read bandwidth and then the step: on a shared machine both move from minute to minute (on a
    2-core AVX2 EPYC the bandwidth 24-34 GB/s and the same step 4-6.6 ms within an hour), so a ratio is taken
    from the two measured together."""
    dtype = "bfloat16" if mode == "bfloat16" else "float32"
    quantization = "gguf" if mode == "int4" else ("none" if model.endswith(".gguf") else None)
    blocks = batch * (-(-(context + 1) // 16)) + 1
    runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, device="cpu", block_size=16,
                                      max_model_len=context + 16, num_kv_blocks=blocks, num_threads=threads,
                                      quantization=quantization))
    torch.set_num_threads(threads)
    weights, kv = decode_step_bytes(runner, batch, context)
    rows = []
    for _ in range(rounds):
        bandwidth = read_bandwidth(clock=clock)
        split = profile_decode(runner, batch, context, steps, clock)
        rows.append(RooflineRow(model.rsplit("/", 1)[-1], mode, batch, context, weights, kv, bandwidth, split))
    return rows


def ratio_summary(rows: list[RooflineRow]) -> str:
    """The median of one row's ratios over its rounds, and their range."""
    ratios = sorted(r.ratio for r in rows)
    r = rows[0]
    return (f"{r.model} {r.mode} B={r.batch}: step / roofline median {ratios[len(ratios) // 2]:.2f}x "
            f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(rows)} rounds)")


def format_table(rows: list[RooflineRow]) -> str:
    # "timed step": the step with timing wrappers whose parts the last five columns are (StepSplit)
    head = ("| model | mode | B | context | weights MB | KV MB | roofline ms | step ms | ratio | timed step ms | "
            "linears ms | attention ms | sampling ms | rest ms | LM head ms | GB/s |\n"
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    lines = [head]
    for r in rows:
        s = r.split
        lines.append(f"| {r.model} | {r.mode} | {r.batch} | {r.context} | {r.weight_bytes / 1e6:.1f} | "
                     f"{r.kv_bytes / 1e6:.2f} | {r.roofline_s * 1e3:.2f} | {s.total_s * 1e3:.2f} | {r.ratio:.2f} | "
                     f"{s.split_total_s * 1e3:.2f} | {s.linear_s * 1e3:.2f} | {s.attention_s * 1e3:.2f} | "
                     f"{s.sampling_s * 1e3:.2f} | {s.rest_s * 1e3:.2f} | {s.head_s * 1e3:.2f} | "
                     f"{r.bandwidth / 1e9:.1f} |")
    return "\n".join(lines)
