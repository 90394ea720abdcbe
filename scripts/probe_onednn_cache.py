"""Which kernel's memory follows new shapes: RSS growth per op family fed new row counts.

    python scripts/probe_onednn_cache.py --shapes 200 --families packed,bf16,plain,int4,sdpa_causal,flash_split
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=16 LRU_CACHE_CAPACITY=16 python scripts/probe_onednn_cache.py --families packed

Each family runs in its own process (one thread) on SmolLM2-135M's four projection shapes
(576 -> 960 qkv, 576 -> 576 o, 576 -> 3072 gate_up, 1536 -> 576 down) or its attention heads
(9 query / 3 KV heads of 64): ``--shapes`` calls, each with a row count in 1-2048 it has not had
(attention: sequence lengths), then 100 calls on row counts it has had. Prints RSS growth (after
malloc_trim) at each quarter and after the repeats. Families: ``packed`` (oneDNN's prepacked
float32 linear, evenflow's PackedCpuLinear), ``bf16`` (F.linear in bfloat16: oneDNN),
``plain`` (F.linear in float32: MKL), ``int4`` (torch's int4 kernel), ``sdpa_causal``,
``flash_split`` (the fused CPU attention on a cached context), ``sdpa_decode`` (masked batched decode).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, INTER = 576, 1536
PROJECTIONS = ((960, H), (H, H), (2 * INTER, H), (H, INTER))  # (out, in)


def _family(name: str, rng: random.Random):
    import torch
    import torch.nn.functional as F

    if name in ("packed", "plain", "bf16"):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        ws = [torch.randn(o, i).to(dtype) for o, i in PROJECTIONS]
        if name == "packed":
            ws = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]

            def gemm(x, w):
                return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        else:
            gemm = F.linear
        return lambda m: [gemm(torch.randn(m, i).to(dtype), w) for w, (_, i) in zip(ws, PROJECTIONS)]
    if name == "int4":
        from evenflow.worker.models.q4_blocks import GROUP, Q4Rows, pack

        g = torch.Generator().manual_seed(0)
        ws = [pack(Q4Rows(torch.randint(0, 16, (o, i), dtype=torch.uint8, generator=g),
                          torch.rand(o, i // GROUP) * 0.01, torch.zeros(o, i // GROUP))) for o, i in PROJECTIONS]
        return lambda m: [torch.ops.aten._weight_int4pack_mm_for_cpu(torch.randn(m, i).bfloat16(), w.packed, GROUP,
                                                                     w.scale_zeros) for w, (_, i) in zip(ws, PROJECTIONS)]
    if name == "sdpa_causal":
        return lambda n: F.scaled_dot_product_attention(torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64),
                                                        torch.randn(1, 3, n, 64), is_causal=True, enable_gqa=True)
    if name == "flash_split":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return lambda n: flash(torch.randn(1, 3, 3 * n, 64), *[torch.randn(1, 3, rng.randrange(8, 2048), 64)] * 2,
                               0.0, False, scale=0.125)
    if name == "sdpa_decode":
        def decode(n: int) -> None:
            b, length = max(1, n % 64), rng.randrange(1, 128) * 16
            F.scaled_dot_product_attention(torch.randn(b, 3, 3, 64), torch.randn(b, 3, length, 64),
                                           torch.randn(b, 3, length, 64), attn_mask=torch.zeros(b, 1, 1, length))
        return decode
    raise ValueError(f"unknown family {name!r}")


def child(name: str, shapes: int) -> None:
    import psutil
    import torch

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")

    def rss() -> float:
        libc.malloc_trim(0)
        return psutil.Process().memory_info().rss / 2**20

    rng = random.Random(0)
    with torch.inference_mode():
        call = _family(name, rng)
        for m in range(1, 6):
            call(m)
        start = rss()
        counts = rng.sample(range(6, 2049), shapes)
        quarters = []
        for j, m in enumerate(counts):
            call(m)
            if (j + 1) % max(shapes // 4, 1) == 0:
                quarters.append(rss() - start)
        for m in counts[:100]:
            call(m)
        print(json.dumps({"quarters": quarters, "repeats": rss() - start}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=200)
    ap.add_argument("--families", default="packed,bf16,plain,int4,sdpa_causal,flash_split,sdpa_decode")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.shapes)
    caps = "/".join(os.environ.get(v, "default") for v in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"))
    print("| family | oneDNN / ideep cache capacity | new row counts | RSS growth at each quarter (MB) "
          "| after 100 repeats (MB) |\n|---|---|---|---|---|")
    for name in args.families.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", name, "--shapes", str(args.shapes)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {caps} | {args.shapes} | {', '.join(f'{q:.1f}' for q in r['quarters'])} "
              f"| {r['repeats']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
