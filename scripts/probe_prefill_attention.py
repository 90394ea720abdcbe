#!/usr/bin/env python3
"""Prefill attention on a bfloat16 paged cache on CPUs with AMX: the C++ kernel
(evenflow/worker/attention/cpu_prefill.py) against PyTorch's attention as TorchPagedAttention runs it without
the kernel (a fresh prompt in one causal call; a chunk after cached context as two calls merged), two ways:

* one layer's attention (``plan`` once, then ``forward``: the K/V write and the attention) for chunks of
  N new tokens after C - N cached ones, ``--shapes N:C,...``, their blocks one range of ids;
* ``--model``: a lone prompt of each length in ``--prompts`` prefilled in one step by that model in process
  (a GGUF with int4 projections: the bfloat16 cache), wall seconds of the step.

The variants alternate order over ``--rounds``; the best round is kept. SmolLM2-135M's heads by default
(9 query heads over 3 KV heads, head_dim 64). Results: docs/results/quantization.md.

    python scripts/probe_prefill_attention.py [--shapes 2048:2048,512:2048,64:2048] [--threads 2]
    python scripts/probe_prefill_attention.py --model SmolLM2-135M-Instruct.Q4_1.gguf --prompts 512,2048
"""

from __future__ import annotations

import argparse

import torch

from evenflow.protocol import NewRequestData, SamplingParams, SchedulerOutput
from evenflow.worker.attention.base import AttentionInputs
from evenflow.worker.attention.torch_paged import TorchPagedAttention
from evenflow.worker.models.kernel_timing import time_min
from evenflow.worker.synthetic_steps import synthetic_step

BLOCK = 16


def chunk_inputs(new: int, context: int) -> AttentionInputs:
    """One chunk of ``new`` tokens ending a ``context``-token context, its blocks one range of ids."""
    return synthetic_step([new], [context], BLOCK, torch.device("cpu")).attn


def layer_table(args: argparse.Namespace) -> None:
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    dt = torch.bfloat16
    backend = TorchPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, dt)
    kernel_fn = backend.prefill_kernel._fn
    if kernel_fn is None:
        raise SystemExit("the prefill kernel does not run here (it needs AMX and a compiler)")
    print(f"{args.threads} threads, best of {args.rounds} rounds of {args.calls} calls\n"
          "| new tokens | context | PyTorch ms | kernel ms | kernel / PyTorch |\n|--:|--:|--:|--:|--:|")
    for shape in args.shapes.split(","):
        new, context = (int(x) for x in shape.split(":"))
        inputs = chunk_inputs(new, context)
        nb = -(-context // BLOCK)
        caches = tuple(torch.randn(nb, BLOCK, kv_heads, head_dim).to(dt) for _ in range(2))
        qkv = torch.randn(new, heads + 2 * kv_heads, head_dim).to(dt)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        best: dict[bool, float] = {}
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                backend.prefill_kernel._fn = kernel_fn if on else None
                plan = backend.plan(inputs)
                s = time_min([lambda: backend.forward(q, k, v, caches, plan)], args.calls)[0]
                best[on] = min(best.get(on, s), s)
        off, on = best[False], best[True]
        print(f"| {new} | {context} | {off * 1e3:.3f} | {on * 1e3:.3f} | {on / off:.2f} |")
    backend.prefill_kernel._fn = kernel_fn


def prompt_table(args: argparse.Namespace) -> None:
    from evenflow.bench.decode_latency import runner_for

    prompts = [int(p) for p in args.prompts.split(",")]
    runner = runner_for(args.model, "int4", max(prompts) + 16, args.threads)
    runner.init_kv_cache((max(prompts) + 16) // BLOCK + 2)
    kernel = runner.attn.prefill_kernel
    kernel_fn = kernel._fn
    if kernel_fn is None:
        raise SystemExit("the model's prompts do not take the kernel here (no bfloat16 cache, AMX or build)")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    step = 0

    def prefill(n: int) -> None:
        nonlocal step
        req = f"p{step}"
        tokens = [3 + (7 * j) % 200 for j in range(n)]
        blocks = list(range(1, -(-(n + 1) // BLOCK) + 1))
        runner.execute_model(SchedulerOutput(step, [NewRequestData(req, tokens, params, blocks, 0)], [], {req: n}, n))
        runner.execute_model(SchedulerOutput(step + 1, [], [], {}, 0, finished_req_ids=[req]))
        step += 2

    best: dict[tuple[bool, int], float] = {}
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            kernel._fn = kernel_fn if on else None
            for n in prompts:
                s = time_min([lambda: prefill(n)], max(args.calls // 10, 2))[0]
                best[(on, n)] = min(best.get((on, n), s), s)
    kernel._fn = kernel_fn
    print(f"{args.model}: a lone prompt in one step, {args.threads} threads, best of {args.rounds} rounds\n"
          "| prompt tokens | PyTorch's attention s | kernel s | kernel / PyTorch |\n|--:|--:|--:|--:|")
    for n in prompts:
        p, k = best[(False, n)], best[(True, n)]
        print(f"| {n} | {p:.3f} | {k:.3f} | {k / p:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a GGUF served with int4 projections: whole prompt steps")
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--shapes", default="2048:2048,512:512,128:128,512:2048,64:2048,16:2048,6:2048,2:2048,2048:8192")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (without --model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        prompt_table(args) if args.model else layer_table(args)


if __name__ == "__main__":
    main()
