#!/usr/bin/env python3
"""A causal prefill's attention: PyTorch's CPU flash kernel with ``is_causal`` against query blocks
that each see exactly their keys, (a) the diagonal block by an additive mask, (b) the past keys
unmasked and the diagonal block causal, merged by log-sum-exp (as TorchPagedAttention._split_chunk
merges a chunk's two parts). SmolLM2-135M's heads (9 q, 3 kv, 64 dims), bfloat16. Results:
docs/results/quantization.md (2026-12-05, compiled elementwise groups).

    python scripts/probe_causal_blocks.py [--tokens 2048] [--blocks 256,512,1024] [--threads 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from evenflow.bench.call_timing import per_call_ms

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def masked_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    n, outs = q.shape[2], []
    for s in range(0, n, block):
        e = min(s + block, n)
        mask = torch.zeros(e - s, e, dtype=q.dtype)
        mask[:, s:] = torch.full((e - s, e - s), float("-inf"), dtype=q.dtype).triu(1)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=mask,
                                                   enable_gqa=True))
    return torch.cat(outs, 2)


def merged_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    n, outs = q.shape[2], []
    for s in range(0, n, block):
        e = min(s + block, n)
        qb = q[:, :, s:e]
        o_new, lse_new = _flash_cpu(qb, k[:, :, s:e], v[:, :, s:e], 0.0, True)[:2]
        if s == 0:
            outs.append(o_new)
            continue
        o_ctx, lse_ctx = _flash_cpu(qb, k[:, :, :s], v[:, :, :s], 0.0, False)[:2]
        w = torch.sigmoid(lse_ctx - lse_new).unsqueeze(-1)
        outs.append(torch.lerp(o_new.float(), o_ctx.float(), w).to(q.dtype))
    return torch.cat(outs, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--blocks", default="256,512,1024")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.tokens
    q = torch.randn(1, HEADS, n, HEAD_DIM).bfloat16()
    k, v = torch.randn(1, KV_HEADS, n, HEAD_DIM).bfloat16(), torch.randn(1, KV_HEADS, n, HEAD_DIM).bfloat16()
    causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    full = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    ref = causal().float()
    variants: dict[str, Callable[[], torch.Tensor]] = {"causal": causal, "non-causal": full}
    for b in (int(x) for x in args.blocks.split(",")):
        variants[f"masked blocks of {b}"] = lambda b=b: masked_blocks(q, k, v, b)
        variants[f"merged blocks of {b}"] = lambda b=b: merged_blocks(q, k, v, b)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(2):  # two rounds, the order reversed in the second
        for name in list(variants) if r == 0 else list(variants)[::-1]:
            times[name].append(per_call_ms(variants[name], 5, warmup=1))
    base = min(times["causal"])
    print(f"| variant | ms | / causal | max abs error |\n|---|--:|--:|--:|")
    for name, fn in variants.items():
        err = "-" if name == "non-causal" else f"{float((fn().float() - ref).abs().max()):.4f}"
        print(f"| {name} | {min(times[name]):.2f} | {min(times[name]) / base:.2f} | {err} |")


if __name__ == "__main__":
    main()
