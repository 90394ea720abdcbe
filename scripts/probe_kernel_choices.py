#!/usr/bin/env python3
"""The kernel-level timings behind the worker's CPU choices, one table each (us or ms a call, min of
interleaved trials, on ``--threads``):

1. ``attention``: a lone decode's attention to its paged context, gathered against read in place
   (``attention/torch_paged.py``'s ``in_place_range``), SmolLM2's heads (9 / 3 KV / 64).
2. ``kv``: SDPA with a float32 against a bfloat16 KV cache (``LlamaModel.kv_dtype``): 8 decodes, a
   128-token chunk's cached context, a 2048-token prompt's causal attention.
3. ``head``: the LM head's 4-bit screen GEMM against its bfloat16 one by rows, on a 49152 x 576
   table (``ScreenedHead.measured_int4_rows``; the GEMMs' time does not depend on the values).
4. ``merge``: the split chunk's merge of its two attention parts, three ops against one lerp.
5. ``tiles``: a 2042-row oneDNN GEMM in 512-row tiles against one call (``row_tiles.TILE_ROWS``).
6. ``copy``: the 30 layers' projections of a many-row step on the int4 plan's bfloat16 copy, as
   ``F.linear`` on the plain weight against oneDNN on the weight laid out once (``packed_kernel``),
   each weight read from memory as a step reads it (ms a step, by rows).

    python scripts/probe_kernel_choices.py --threads 2
    python scripts/probe_kernel_choices.py --threads 2 --only attention,kv
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from evenflow.worker.attention.torch_paged import _flash_cpu
from evenflow.worker.models.linear import PackedCpuLinear, cpu_has_fast_path
from evenflow.worker.models.lm_head import ScreenedHead
from evenflow.worker.models import row_tiles

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M's attention, 16-token blocks
G = H // HKV


def best_us(fns: list[Callable[[], object]], calls: int, trials: int = 5) -> list[float]:
    """Microseconds a call of each function: min over trials of ``calls`` calls, interleaved."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(trials):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def attention() -> None:
    print("| context | gathered us | in place us |\n|--:|--:|--:|")
    for ctx in (130, 400, 2000):
        nb = -(-ctx // BS)
        kc, vc = torch.randn(nb + 50, BS, HKV, D), torch.randn(nb + 50, BS, HKV, D)
        ids = torch.arange(5, 5 + nb)
        q = torch.randn(1, HKV, G, D)
        mask = torch.zeros(1, 1, 1, nb * BS)
        mask[..., ctx:] = float("-inf")

        def gathered() -> torch.Tensor:
            k = kc.index_select(0, ids).view(1, nb * BS, HKV, D).transpose(1, 2)
            v = vc.index_select(0, ids).view(1, nb * BS, HKV, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)

        def in_place() -> torch.Tensor:
            k = kc[5 : 5 + nb].view(1, nb * BS, HKV, D).transpose(1, 2)
            v = vc[5 : 5 + nb].view(1, nb * BS, HKV, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)

        a, b = best_us([gathered, in_place], 200)
        print(f"| {ctx} | {a:.1f} | {b:.1f} |")


def kv() -> None:
    print("| shape | float32 cache | bfloat16 cache |\n|---|--:|--:|")
    dtypes = (torch.float32, torch.bfloat16)
    for b, ctx in ((8, 130), (8, 250)):
        nb = -(-ctx // BS)
        ids = torch.randperm(b * nb + 100)[: b * nb]
        row = []
        for dt in dtypes:
            kc, vc = (torch.randn(b * nb + 100, BS, HKV, D).to(dt) for _ in range(2))
            q = torch.randn(b, HKV, G, D).to(dt)
            mask = torch.zeros(b, 1, 1, nb * BS, dtype=dt)
            mask[..., ctx:] = float("-inf")

            def group(kc: torch.Tensor = kc, vc: torch.Tensor = vc, q: torch.Tensor = q,
                      mask: torch.Tensor = mask) -> torch.Tensor:
                k = kc.index_select(0, ids).view(b, nb * BS, HKV, D).transpose(1, 2)
                v = vc.index_select(0, ids).view(b, nb * BS, HKV, D).transpose(1, 2)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)

            row.append(best_us([group], 200)[0])
        print(f"| {b} decodes x {ctx} tokens, us | {row[0]:.0f} | {row[1]:.0f} |")
    row = []
    for dt in dtypes:
        grouped = torch.randn(1, HKV, G * 128, D).to(dt)
        k, v = (torch.randn(1, HKV, 1024, D).to(dt) for _ in range(2))
        row.append(best_us([lambda: _flash_cpu(grouped, k, v, 0.0, False, scale=D**-0.5)], 20)[0] / 1e3)
    print(f"| a 128-token chunk's 1,024 cached tokens, ms | {row[0]:.3f} | {row[1]:.3f} |")
    row = []
    for dt in dtypes:
        q = torch.randn(1, 2048, H, D).to(dt).transpose(1, 2)
        k, v = (torch.randn(1, 2048, HKV, D).to(dt).transpose(1, 2) for _ in range(2))
        row.append(best_us([lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5,
                                                                   enable_gqa=True)], 2, trials=3)[0] / 1e3)
    print(f"| a 2048-token prompt, causal, ms | {row[0]:.1f} | {row[1]:.1f} |")


def head() -> None:
    table = torch.randn(49152, 576) * 0.05
    screen = ScreenedHead(table, "bfloat16" if cpu_has_fast_path(torch.bfloat16) else "float16")
    print(f"| rows | 4-bit screen GEMM ms | {screen.kind} screen GEMM ms |\n|--:|--:|--:|")
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, 576)
            a, b = best_us([lambda: screen.int4(x), lambda: screen._screen_logits(x)], 20)
            print(f"| {rows} | {a / 1e3:.3f} | {b / 1e3:.3f} |")


def merge() -> None:
    n = 128
    o_new = torch.randn(1, n, H, D).bfloat16().transpose(1, 2)  # the kernel's output layout
    o_ctx = torch.randn(1, H, n, D).bfloat16()
    w = torch.sigmoid(torch.randn(1, H, n, 1))

    def three_ops() -> torch.Tensor:
        a = o_new.float()
        return (a + w * (o_ctx.float() - a)).to(o_ctx.dtype)

    def lerp() -> torch.Tensor:
        return torch.lerp(o_new.float(), o_ctx.float(), w).to(o_ctx.dtype)

    a, b = best_us([three_ops, lerp], 2000)
    print(f"| merge of a {n}-token chunk, bfloat16 | a + w * (b - a): {a:.1f} us | lerp: {b:.1f} us |")


def tiles() -> None:
    kernel = PackedCpuLinear()
    print("| dtype | out x in | 512-row tiles ms | one call ms |\n|---|---|--:|--:|")
    for dt in (torch.float32, torch.bfloat16):
        for n, k in ((3072, 576), (576, 1536)):
            packed = kernel.prepare(torch.randn(n, k).to(dt))
            x = torch.randn(2042, k).to(dt)

            def gemm(rows: torch.Tensor, packed: torch.Tensor = packed) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

            def in_512(x: torch.Tensor = x, gemm: Callable = gemm) -> torch.Tensor:
                tile_rows, row_tiles.TILE_ROWS = row_tiles.TILE_ROWS, 512  # the tiles before 2026-12-04
                try:
                    return row_tiles.in_row_tiles(gemm, x)
                finally:
                    row_tiles.TILE_ROWS = tile_rows

            a, b = best_us([in_512, lambda: gemm(x)], 5)
            print(f"| {str(dt)[6:]} | {n} x {k} | {a / 1e3:.2f} | {b / 1e3:.2f} |")


def copy() -> None:
    kernel = PackedCpuLinear()
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's qkv, o, gate_up, down
    plain = {s: [torch.randn(*s).bfloat16() for _ in range(30)] for s in shapes}
    packed = {s: [kernel.prepare(w) for w in ws] for s, ws in plain.items()}
    print("| rows | F.linear, plain ms | packed ms | packed / plain |\n|--:|--:|--:|--:|")
    for rows in (9, 16, 32, 64, 144, 192, 288, 576, 1024, 2048):
        xs = {s: torch.randn(rows, s[1]).bfloat16() for s in shapes}

        def step_plain() -> None:
            for s, ws in plain.items():
                for w in ws:
                    F.linear(xs[s], w)

        def step_packed() -> None:
            for s, ws in packed.items():
                for w in ws:
                    kernel(xs[s], w)

        a, b = best_us([step_plain, step_packed], 1)
        print(f"| {rows} | {a / 1e3:.1f} | {b / 1e3:.1f} | {b / a:.2f} |")


PROBES = {"attention": attention, "kv": kv, "head": head, "merge": merge, "tiles": tiles, "copy": copy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--only", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.only.split(","):
        print(f"\n{name} ({args.threads} threads)")
        PROBES[name]()


if __name__ == "__main__":
    main()
