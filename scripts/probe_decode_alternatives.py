#!/usr/bin/env python3
"""Two ways to a faster single stream that were measured and not kept, on the real GGUF:

1. ``compile``: torch.compile (inductor, C++ kernels; ``--cpp-wrapper`` for its C++ wrapper) of a
   decode layer's two attention-free halves (norm + qkv + rotary; o + residual + norm + gate_up +
   SiLU-mul + down + residual) at one row, timed over the 30 layers against the same code eager.
2. ``int8``: FBGEMM's dynamic int8 linear (int8 weights per output row, activations quantized per
   tensor at run time, ``quantized::linear_dynamic``) in place of every 4-bit projection, scored by
   the perplexity of the accuracy gate's text against the float32 path.

    python scripts/probe_decode_alternatives.py --model SmolLM2-135M-Instruct.Q4_1.gguf compile
    python scripts/probe_decode_alternatives.py --model M.gguf int8
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real.scoring, the gate's text
from evenflow.bench.call_timing import per_call_ms  # noqa: E402
from evenflow.worker.models.int4_linear import Int4CpuLinear  # noqa: E402
from evenflow.worker.models.layers import apply_rotary  # noqa: E402
from evenflow.worker.models.q4_blocks import Int4Weight  # noqa: E402
from evenflow.worker.runner import ModelRunner  # noqa: E402
from tests.real.scoring import score  # noqa: E402
from tests.real.test_int4_accuracy import TEXT  # noqa: E402
from tests.worker.harness import make_runner  # noqa: E402


def probe_compile(runner: ModelRunner, cpp_wrapper: bool, rounds: int) -> None:
    import torch._inductor.config as inductor

    inductor.cpp_wrapper = cpp_wrapper
    torch._dynamo.config.cache_size_limit = 64
    m = runner.model
    lin, inter, qk_end, d = m.linear, m.intermediate, m.q_size + m.kv_size, m.cfg.head_dim
    heads = m.num_heads + m.num_kv_heads

    def pre(x, w, scaled, cos, sin):  # type: ignore[no-untyped-def]
        qkv = lin(m._norm(x, None, scaled, torch.bfloat16), w.qkv, None)
        return apply_rotary(qkv[:, :qk_end].view(1, heads, d), cos, sin), qkv[:, qk_end:]

    def post(x, o, w, scaled):  # type: ignore[no-untyped-def]
        x = x + lin(o, w.o, None)
        gu = lin(m._norm(x, None, scaled, torch.bfloat16), w.gate_up, None)
        return x + lin(F.silu(gu[:, :inter]) * gu[:, inter:], w.down, None)

    x, o = torch.randn(1, m.cfg.hidden_size), torch.randn(1, m.num_heads * d, dtype=torch.bfloat16)
    cos, sin = m.rotary.lookup(torch.tensor([100]))
    layers = list(zip(m._linears, m._scaled_norms))

    def run_pre(f: Callable) -> None:
        for w, (scaled, _) in layers:
            f(x, w, scaled, cos, sin)

    def run_post(f: Callable) -> None:
        for w, (_, scaled) in layers:
            f(x, o, w, scaled)

    t0 = time.perf_counter()
    cpre, cpost = torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False)
    run_pre(cpre)
    run_post(cpost)
    print(f"compile (cpp_wrapper={cpp_wrapper}): {time.perf_counter() - t0:.1f} s; ms over 30 layers, one row")
    print("| round | pre eager | pre compiled | post eager | post compiled |\n|--:|--:|--:|--:|--:|")
    for r in range(rounds):
        t = [per_call_ms(lambda: run(f), 200, warmup=5) for run, f in ((run_pre, pre), (run_pre, cpre), (run_post, post),
                                                                (run_post, cpost))]
        print(f"| {r} | " + " | ".join(f"{v:.2f}" for v in t) + " |")


class DynamicInt8Linear:
    """Every 4-bit projection through FBGEMM's dynamic int8 linear (weights from their float32 values)."""

    def __init__(self, inner: Int4CpuLinear, reduce_range: bool) -> None:
        self.inner, self.reduce_range, self.packed = inner, reduce_range, {}

    def act_dtype(self, weight: object, rows: int) -> torch.dtype:
        return torch.float32

    def __call__(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed.get(id(w))
        if packed is None:
            dense = w.dequantize(torch.empty(w.out_features, w.in_features))
            scale = (dense.abs().amax(1).clamp_min(1e-8) / 127).double()
            qw = torch.quantize_per_channel(dense, scale, torch.zeros(dense.shape[0], dtype=torch.long), 0, torch.qint8)
            packed = self.packed[id(w)] = torch.ops.quantized.linear_prepack(qw, None)
        y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), packed, self.reduce_range)
        return y if bias is None else y + bias


def probe_int8(model: Path, int4: ModelRunner) -> None:
    from evenflow.frontend.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(str(model)).encode(TEXT)
    reference = score(make_runner(model, num_blocks=64, block_size=16, max_model_len=512, quantization="none"),
                      ids, len(ids)).perplexity
    kernel = int4.model.linear
    print(f"perplexity of the gate's text ({len(ids)} tokens): float32 {reference:.3f}, "
          f"int4 kernel 4 rows a step {score(int4, ids, 4).perplexity:.3f}")
    for reduce_range in (True, False):
        int4.model.linear = DynamicInt8Linear(kernel, reduce_range)
        for rows in (1, 4):
            ppl = score(int4, ids, rows).perplexity
            print(f"dynamic int8, reduce_range={reduce_range}, {rows} rows a step: {ppl:.3f} ({ppl / reference:.3f}x)")
    int4.model.linear = kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("probe", choices=["compile", "int8"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpp-wrapper", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
    torch.set_num_threads(args.threads)
    runner = make_runner(args.model, num_blocks=64, block_size=16, max_model_len=512, quantization="gguf")
    assert isinstance(runner.model.linear, Int4CpuLinear)
    with torch.inference_mode():
        if args.probe == "compile":
            probe_compile(runner, args.cpp_wrapper, args.rounds)
        else:
            probe_int8(args.model, runner)


if __name__ == "__main__":
    main()
