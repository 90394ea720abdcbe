#!/usr/bin/env python3
"""flash-attn vs triton vs torch on one random paged step: max difference and time per call.

    python scripts/compare_attention.py [--dtype bfloat16] [--device cuda] [--block-size 256]

One step of decodes and prefill chunks (contexts over several blocks) on a random KV cache, run
through every attention backend this machine has; the torch backend is the reference. Exits 1
when a backend differs from it by more than the dtype's tolerance (float32 1e-3, float16 1e-2,
bfloat16 3e-2). scripts/gpu_check.sh runs it on a CUDA machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from evenflow.worker.attention.selector import flash_attn_problem, triton_available
from evenflow.worker.attention.torch_paged import TorchPagedAttention
from evenflow.worker.synthetic_steps import synthetic_step

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# (new tokens, context length): 32 decodes of growing contexts, then fresh and continuing chunks.
SHAPES = [(1, 64 + 37 * i) for i in range(32)] + [(512, 512), (128, 1200), (16, 700)]


def backends(dtype: torch.dtype, device: torch.device) -> list[type]:
    found: list[type] = [TorchPagedAttention]
    if device.type == "cuda" and triton_available():
        from evenflow.worker.attention.triton_paged import TritonPagedAttention

        found.append(TritonPagedAttention)
    if device.type == "cuda" and dtype != torch.float32 and flash_attn_problem() is None:
        from evenflow.worker.attention.flash import FlashAttention

        found.append(FlashAttention)
    return found


def run(backend_cls: type, dtype: torch.dtype, device: torch.device, block_size: int, seed: int,
        iters: int) -> tuple[torch.Tensor, float]:
    heads, kv_heads, head_dim = 32, 8, 64
    step = synthetic_step([q for q, _ in SHAPES], [c for _, c in SHAPES], block_size, device)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    cache = (draw(step.num_blocks, block_size, kv_heads, head_dim), draw(step.num_blocks, block_size, kv_heads, head_dim))
    n = step.attn.num_tokens
    q, k, v = draw(n, heads, head_dim), draw(n, kv_heads, head_dim), draw(n, kv_heads, head_dim)
    backend = backend_cls(heads, kv_heads, head_dim, head_dim**-0.5, dtype)
    plan = backend.plan(step.attn)
    out = backend.forward(q, k, v, cache, plan)  # also the warm-up (Triton compiles here)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        backend.forward(q, k, v, cache, plan)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.float().cpu(), (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--block-size", type=int, default=256, help="tokens per block (flash-attn needs 256)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    results = {cls.name: run(cls, dtype, device, args.block_size, args.seed, args.iters)
               for cls in backends(dtype, device)}
    reference = results["torch"][0]
    ok = True
    print(f"attention backends, {args.dtype} on {device}, block size {args.block_size}, {len(SHAPES)} requests")
    print("| backend | ms per call | max abs diff vs torch |")
    print("|---|--:|--:|")
    for name, (out, ms) in results.items():
        diff = (out - reference).abs().max().item()
        ok &= diff <= TOLERANCE[dtype]
        print(f"| {name} | {ms:.3f} | {diff:.2e} |")
    if "flash_attn" not in results and device.type == "cuda" and dtype != torch.float32:
        print(f"flash_attn not compared: {flash_attn_problem()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
