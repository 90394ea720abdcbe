"""The int4 linear: GGUF Q4 weights kept 4-bit, the kernel chosen per step shape by a measurement.

Decode is bound by the bytes of weights a step reads, and torch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``, bfloat16 activations) reads 0.625 bytes a parameter (4 bits, a
bf16 scale and zero per 32) against float32's 4; but it dequantizes per row, so from some rows on
a dense GEMM (bfloat16 where the CPU has native bf16, else float32) is faster. Its weight is
either dequantized per step and layer, which costs the GEMM of a hundred-odd rows, or kept as a
dense copy made at load (where the copy fits in ``DENSE_COPY_RAM_SHARE`` of the RAM), which makes
a chunk of a few dozen prompt tokens cost what it costs in an unchunked prefill. The copy is
laid out once for oneDNN (``PackedCpuLinear``), as the dense paths' weights are: ``F.linear`` on a
plain bfloat16 weight re-lays it out in every call. On a 2-core Xeon with AMX the 30 layers' GEMMs
of a step took 0.67-0.83x the plain weight's time from 9 to 192 rows with the packed one (9 rows
11.6 against 17.3 ms, 144 rows 23.2 against 27.9), 0.91-0.97x at 288-576 and 1.06-1.09x at
1024-2048 (``scripts/probe_kernel_choices.py --only copy``): the steps that chunked prefill and
decode batches make are the first kind. Where the
crossovers lie differs by CPU, so ``measure_int4_plan`` times the kernels at start-up on the
model's widest projection and ``Int4CpuLinear`` uses the plan; the choice is logged.

Only the projections are int4. Dense weights (the embeddings and LM head, 4-bit tensors whose
rows do not fill the kernel's 64-row tiles) go through the dense kernel this wraps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Literal

import psutil
import torch
import torch.nn.functional as F
from evenflow.worker.models.fp16_gemm import fp16_gemm_works, fp16_linear, pack_fp16
# A torch without its int4 kernel fails layout_matches(), so no Int4CpuLinear is built there.
from evenflow.worker.models.int4_gemv import TORCH_INT4_MM as _INT4_MM
from evenflow.worker.models.int4_gemv import (
    NO_GEMV, GemvRows, gemv_layout, gemv_rows, int4_product, load_int4_gemv, takes_gemv,
)
from evenflow.worker.models.kernel_timing import (
    COPY_PROBE_BYTES, INT4_RUN, int4_from_memory, on_every_core, time_min,
)
from evenflow.worker.models.linear import Linear, PackedCpuLinear, pick_linear
from evenflow.worker.models.q4_blocks import GROUP, PACK_TILE_ROWS, Int4Weight, Q4Rows, pack, pack_tile_rows
from evenflow.worker.models.row_tiles import in_row_tiles

log = logging.getLogger("evenflow.worker.int4")

# Row counts the start-up measurement tries (decode batches up to chunked prefills).
_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Where evenflow's GEMV wins the probes up to the last two it is timed once more at this many rows against the
# dense path: from a few rows both are bound by arithmetic, their costs linear in the rows, so a GEMV that wins
# here takes every row count (on a 2-core AVX2 EPYC: 0.85-0.91x FBGEMM's float16 copy at 256-2048 rows on
# SmolLM2's shapes), and no dense copy is kept. The last probe alone is too close to call from memory there
# (256 rows: 4.4-5.2 ms against 5.2-5.4), where 1024 rows are not (17.6-19.8 against 22.3-26.5).
_CONFIRM_ROWS = 1024
EVERY_ROW = 1 << 30  # ``max_int4_rows`` of a plan whose int4 path takes every row count
# The 4-bit weights are what lets a model fit: a dense copy for many-row steps must not be what makes
# it not fit (the KV cache, sized after the weights, takes its share of what is left).
DENSE_COPY_RAM_SHARE = 0.25


@dataclass(frozen=True)
class Int4Plan:
    """Which kernel runs a step of ``rows`` rows: int4 up to ``max_int4_rows``, else dense in ``dense_dtype``."""

    max_int4_rows: int  # 0: the int4 kernel never won, weights should be dequantized at load
    dense_dtype: torch.dtype  # float16: FBGEMM's float16-weight GEMM on a copy (models/fp16_gemm.py)
    reason: str
    dense_copy: bool = False  # many-row steps read a dense copy made at load instead of dequantizing
    gemv_rows: GemvRows = NO_GEMV  # of the int4 rows, those evenflow's GEMV takes (models/int4_gemv.py), not torch's

    def takes_int4(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs on the int4 kernel (else on the dense path)."""
        return rows <= self.max_int4_rows

    @property
    def every_row(self) -> bool:
        """Whether the int4 path takes every row count (no dense path runs)."""
        return self.max_int4_rows >= EVERY_ROW

    def act_dtype(self, rows: int) -> torch.dtype:
        """The dtype a 4-bit weight's product computes in at ``rows`` rows: the int4 kernel's bfloat16, else
        the dense path's."""
        return torch.bfloat16 if self.takes_int4(rows) else self.dense_act_dtype

    @property
    def dense_act_dtype(self) -> torch.dtype:
        """The dtype many-row steps compute in: float16 weights take float32 activations."""
        return torch.float32 if self.dense_dtype == torch.float16 else self.dense_dtype


class Int4CpuLinear:
    """``__call__(x, weight, bias)`` for ``Int4Weight`` weights per the plan; dense weights pass to ``dense``."""

    name = "int4"

    def __init__(self, dense: Linear, plan: Int4Plan) -> None:
        self.dense = dense
        self.plan = plan
        self._scratch: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # one dequantized weight per shape
        self.prepare = dense.prepare  # dense weights are laid out by the wrapped kernel
        self._copy_kernel = packed_kernel(plan.dense_dtype)  # lays out and multiplies a dense copy

    def act_dtype(self, weight: torch.Tensor | Int4Weight, rows: int) -> torch.dtype:
        """The dtype a step of ``rows`` rows computes ``weight``'s product in; an ``x`` already in it is
        not cast, and the result comes back in ``x``'s dtype."""
        if type(weight) is not Int4Weight:
            return self.dense.act_dtype(weight, rows)
        return self.plan.act_dtype(rows)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if type(weight) is not Int4Weight:
            want = self.dense.act_dtype(weight, x.shape[0])
            return self.dense(x if x.dtype == want else x.to(want), weight, bias)
        kernel = self.kernel(x.shape[0])
        if kernel != "dense":
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # the model's calls are bfloat16
            y = int4_product(xb, weight, self.plan.gemv_rows)
            y = y if x.dtype == torch.bfloat16 else y.to(x.dtype)
        elif self.plan.dense_dtype == torch.float16 and isinstance(weight.dense, torch.ScriptObject):
            y = fp16_linear(x.float(), weight.dense).to(x.dtype)
        else:
            act = self.plan.dense_act_dtype
            dense = weight.dense
            if packed_copy(weight, act):
                assert self._copy_kernel is not None  # a packed copy is made only by laid_out
                y = self._copy_kernel(x.to(act), dense).to(x.dtype)
            else:
                if not isinstance(dense, torch.Tensor) or dense.dtype != act:
                    dense = weight.dequantize(self._scratch_for(weight))
                # oneDNN (bfloat16) keeps a primitive per row count: bounded by row_tiles.
                y = in_row_tiles(lambda rows: F.linear(rows, dense), x.to(act)).to(x.dtype)
        return y if bias is None else y + bias

    def kernel(self, rows: int) -> Literal["gemv", "int4", "dense"]:
        """What multiplies a 4-bit weight at ``rows`` rows: evenflow's GEMV, torch's int4 kernel, or the dense path."""
        if not self.plan.takes_int4(rows):
            return "dense"
        return "gemv" if takes_gemv(rows, self.plan.gemv_rows) else "int4"

    def step_nbytes(self, weight: Int4Weight, rows: int) -> int:
        """Bytes of ``weight`` a step of ``rows`` rows reads: the 4-bit weight, or the dense copy it reads."""
        if self.plan.takes_int4(rows) or weight.dense is None:
            return weight.nbytes
        return weight.out_features * weight.in_features * self.plan.dense_dtype.itemsize

    def laid_out(self, weight: Int4Weight) -> Int4Weight:
        """``weight`` with what the plan reads besides torch's layout: the scales in the GEMV's order where the
        plan gives it rows (models/int4_gemv.py's ``gemv_layout``), the dense copy for many-row steps where it
        keeps one."""
        if self.plan.gemv_rows.first <= self.plan.gemv_rows.last:
            weight = gemv_layout(weight)
        if not self.plan.dense_copy:
            return weight
        shape = (weight.out_features, weight.in_features)
        if self.plan.dense_dtype == torch.float16:
            return replace(weight, dense=pack_fp16(weight.dequantize(self._scratch_for(weight))))
        dense = weight.dequantize(torch.empty(shape, dtype=self.plan.dense_dtype))
        return replace(weight, dense=dense if self._copy_kernel is None else self._copy_kernel.prepare(dense))

    def _scratch_for(self, weight: Int4Weight) -> torch.Tensor:
        key = (weight.out_features, weight.in_features, self.plan.dense_act_dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(key[:2], dtype=key[2])
        return buf


def packed_copy(weight: Int4Weight, dtype: torch.dtype) -> bool:
    """Whether ``weight`` keeps a dense copy in ``dtype`` laid out for oneDNN (``packed_kernel``'s), which
    many-row steps multiply by oneDNN's linear."""
    dense = weight.dense
    return isinstance(dense, torch.Tensor) and dense.is_mkldnn and dense.dtype == dtype


@cache
def packed_kernel(dtype: torch.dtype) -> PackedCpuLinear | None:
    """oneDNN's linear on a weight laid out once, for a dense copy in ``dtype``: the kernel the dense
    paths pick for it, where that is the packed one (else None: the copy is multiplied by ``F.linear``)."""
    kernel = pick_linear(dtype, torch.device("cpu"))
    return kernel if isinstance(kernel, PackedCpuLinear) else None


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether ``Int4Weight`` can hold a weight of this shape (whole 64-row tiles, whole groups)."""
    return out_features % PACK_TILE_ROWS == 0 and in_features % GROUP == 0


@cache
def layout_matches() -> bool:
    """Whether this torch packs int4 in a tile layout ``Int4Weight.dequantize`` reads (its values,
    scales and zeros included); a torch that changes it keeps 4-bit weights off rather than
    computing wrong values."""
    if pack_tile_rows() is None:
        log.info("int4 kernel unavailable in this torch, or its packing is not a layout evenflow reads")
        return False
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (2 * PACK_TILE_ROWS, 2 * GROUP), dtype=torch.uint8, generator=g)
    scale = torch.rand(q.shape[0], 2, generator=g).bfloat16().float()
    zero = torch.rand(q.shape[0], 2, generator=g).bfloat16().float()
    w = pack(Q4Rows(q, scale, zero))
    expect = (q.float().view(-1, 2, GROUP) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    got = w.dequantize(torch.empty(q.shape, dtype=torch.float32))
    return torch.allclose(got, expect.view_as(got), rtol=1e-6, atol=1e-6)


def _from_memory(weight: torch.Tensor, fp16: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product with a dense copy of ``weight`` as a step computes it (``fp16``: FBGEMM's float16
    copy; else the packed oneDNN copy where this torch has one, else ``F.linear``), read from memory
    as a step reads it: each call takes the next of enough copies (``COPY_PROBE_BYTES``) that the
    previous calls have evicted it from the cache."""
    nbytes = weight.numel() * (2 if fp16 else weight.element_size())
    packed = None if fp16 else packed_kernel(weight.dtype)
    count = -(-COPY_PROBE_BYTES // nbytes)
    copies = [pack_fp16(weight) if fp16 else weight.clone() if packed is None else packed.prepare(weight)
              for _ in range(count)]
    turn = [0]

    def linear(x: torch.Tensor) -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(copies)
        if fp16:
            return fp16_linear(x, copies[turn[0]])
        return F.linear(x, copies[turn[0]]) if packed is None else packed(x, copies[turn[0]])

    return linear


def measure_int4_plan(shape: tuple[int, int], bf16_fast: bool, copy_params: int = 0,
                      available_bytes: int | None = None) -> Int4Plan:
    """Time int4 against the dense paths on one projection of ``shape`` (out, in) at every probe size.

    The dense GEMM for many rows is bfloat16 where ``bf16_fast`` (native bf16) and measured faster
    than float32 at the largest probe, else float32. Its weight is dequantized per step (its cost
    included: a step pays it once per layer) or, when a dense copy of the ``copy_params`` projection
    parameters fits in ``DENSE_COPY_RAM_SHARE`` of ``available_bytes`` (the RAM available now when
    None), read from that copy, timed from memory; the copy is kept where it beats dequantizing at
    every probe size int4 does not win. A float16 copy (FBGEMM, models/fp16_gemm.py) replaces
    either where it fits and beats it at every probe size int4 does not win. Where evenflow's GEMV wins
    every probe from its first to at least the last but one, it is timed against the chosen dense path at
    ``_CONFIRM_ROWS`` rows, and takes every row count if it wins there.
    """
    if not layout_matches():
        return Int4Plan(0, torch.float32, "this torch's int4 packing is not the layout evenflow reads")
    n, k = shape
    g = torch.Generator().manual_seed(0)
    weight = gemv_layout(pack(Q4Rows(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                                     torch.rand(n, k // GROUP, generator=g) * 0.01, torch.zeros(n, k // GROUP))))
    big = torch.randn(_PROBE_ROWS[-1], k, generator=g)
    dense = {dtype: weight.dequantize(torch.empty(shape, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)}
    dtypes = [torch.float32, torch.bfloat16] if bf16_fast else [torch.float32]
    with torch.inference_mode():
        costs = time_min([lambda dtype=dtype: F.linear(big.to(dtype), dense[dtype]) for dtype in dtypes]
                          + [lambda dtype=dtype: weight.dequantize(dense[dtype]) for dtype in dtypes])
        dequant_s = dict(zip(dtypes, costs[len(dtypes):]))
        dense_dtype = min(dtypes, key=lambda dtype: costs[dtypes.index(dtype)] + dequant_s[dtype])
        available = psutil.virtual_memory().available if available_bytes is None else available_bytes
        copy_bytes = copy_params * dense_dtype.itemsize
        copy_fits = 0 < copy_bytes <= DENSE_COPY_RAM_SHARE * available
        from_copy = _from_memory(dense[dense_dtype]) if copy_fits else None
        fp16_fits = fp16_gemm_works() and 0 < copy_params * 2 <= DENSE_COPY_RAM_SHARE * available
        from_fp16 = _from_memory(dense[torch.float32], fp16=True) if fp16_fits else None

        copies = [f for f in (from_copy, from_fp16) if f is not None]
        int4_run = int4_from_memory(weight)
        gemv = load_int4_gemv()
        probes: list[tuple[int, float, float, float, float]] = []  # rows, int4, dequantized, copy, fp16 (s)
        gemv_detail: dict[int, tuple[float, float]] = {}  # rows: torch's int4 kernel, the GEMV (s)
        for rows in _PROBE_ROWS:
            x = big[:rows]
            xd, xb = x.to(dense_dtype), x.bfloat16()
            int4_s, matmul_s, *copy_s = time_min([
                lambda: int4_run(lambda w: _INT4_MM(xb, w.packed, GROUP, w.scale_zeros)),
                lambda: F.linear(xd, dense[dense_dtype]),
            ] + [lambda f=f: f(x if f is from_fp16 else xd) for f in copies]
              + ([lambda: int4_run(lambda w: gemv(xb, w))] if gemv is not None else []))
            int4_s /= INT4_RUN
            if gemv is not None:
                *copy_s, gemv_s = copy_s
                gemv_detail[rows] = (int4_s, gemv_s / INT4_RUN)
            timed = dict(zip(copies, copy_s))
            probes.append((rows, int4_s, dequant_s[dense_dtype] + matmul_s, timed.get(from_copy, float("inf")),
                           timed.get(from_fp16, float("inf"))))
        # Float32 weights kept, as a step reads them: from memory, not from the cache one weight fills.
        f32_kept = from_copy if from_copy and dense_dtype == torch.float32 else _from_memory(dense[torch.float32])
        f32_one = time_min([lambda: f32_kept(big[:1])])[0]
        timed_copy = from_copy is not None
    by_gemv = gemv_rows(gemv_detail)
    probes = [(rows, gemv_detail[rows][1] if takes_gemv(rows, by_gemv) else i, *rest) for rows, i, *rest in probes]
    name = str(dense_dtype)[6:]
    detail = "; ".join((f"{rows}: int4 {gemv_detail[rows][0] * 1e3:.3f} / GEMV {gemv_detail[rows][1] * 1e3:.3f}"
                        if gemv_detail else f"{rows}: int4 {i * 1e3:.3f}") + f" / dequant+{name} {d * 1e3:.3f}"
                       + (f" / {name} copy {c * 1e3:.3f}" if timed_copy else "")
                       + (f" / float16 copy {h * 1e3:.3f}" if from_fp16 else "") + " ms" for rows, i, d, c, h in probes)
    if probes[0][1] >= min(f32_one, probes[0][2]):
        return Int4Plan(0, dense_dtype, f"the int4 kernel was slower than float32 at one row ({detail})")
    # A dense path is compared where int4 does not win against it, and always at the largest probe: where
    # the GEMV wins at every probe, a comparison over no probes chose a copy slower than the other.
    last = _PROBE_ROWS[-1]
    use_copy = timed_copy and all(c < d for rows, i, d, c, _ in probes if i >= c or rows == last)
    dense_s = [c if use_copy else d for _, i, d, c, _ in probes]
    if from_fp16 is not None and all(h < m for (rows, i, _, _, h), m in zip(probes, dense_s) if i >= h or rows == last):
        dense_dtype, use_copy, name = torch.float16, True, "float16 (FBGEMM)"
        copy_bytes, dense_s = copy_params * 2, [h for *_, h in probes]
    max_rows = max(rows for (rows, i, *_), m in zip(probes, dense_s) if i < m or rows == 1)
    many = (f"a {name} copy above ({copy_bytes / 2**30:.2f} GiB)" if use_copy
            else f"dequantized {name} above" + ("" if copy_fits or not copy_params else
                                                f" (a {copy_bytes / 2**30:.2f} GiB copy would not fit)"))
    by_gemv = GemvRows(by_gemv.first, min(by_gemv.last, max_rows))
    if gemv is not None and by_gemv.last >= _PROBE_ROWS[-2]:
        def dense_path(x: torch.Tensor) -> object:  # the dense path the plan chose, as a step runs it
            if dense_dtype == torch.float16:
                assert from_fp16 is not None
                return from_fp16(x)
            if use_copy:
                assert from_copy is not None
                return from_copy(x.to(dense_dtype))
            return weight.dequantize(dense[dense_dtype]), F.linear(x.to(dense_dtype), dense[dense_dtype])

        x = torch.randn(_CONFIRM_ROWS, k, generator=g)
        xb = x.bfloat16()
        with torch.inference_mode():
            gemv_s, dense_run_s = time_min([lambda: gemv(xb, weight), lambda: dense_path(x)], trials=2)
        beyond = f"; {_CONFIRM_ROWS} rows: GEMV {gemv_s * 1e3:.2f} / {name} {dense_run_s * 1e3:.2f} ms"
        if gemv_s < dense_run_s:
            plan_gemv = GemvRows(by_gemv.first, EVERY_ROW)
            return Int4Plan(EVERY_ROW, dense_dtype, f"int4 at every row count (evenflow's GEMV from {by_gemv.first}"
                            f" row{'s' if by_gemv.first > 1 else ''}), no dense copy, on {n}x{k} ({detail}{beyond})",
                            False, plan_gemv)
        detail += beyond
    up_to = f"int4 up to {max_rows} row{'s' if max_rows > 1 else ''}"
    gemv_part = f" (evenflow's GEMV for {by_gemv.first}-{by_gemv.last})" if by_gemv.last >= by_gemv.first else ""
    return Int4Plan(max_rows, dense_dtype, f"{up_to}{gemv_part}, {many}, on {n}x{k} ({detail})", use_copy, by_gemv)


_PLANS: dict[tuple[tuple[int, int], bool, int], Int4Plan] = {}
# Start-ups that ran beside a busy process (the frontend loading, a test) once timed the int4 kernel at
# 5x its cost and served the whole model in float32: a verdict that int4 never wins is measured again.
_PLAN_ATTEMPTS = 3


def int4_plan(shape: tuple[int, int], bf16_fast: bool, copy_params: int = 0) -> Int4Plan:
    """``measure_int4_plan`` once per process and shape, on every usable core, logged."""
    key = (shape, bf16_fast, copy_params)
    if key not in _PLANS:
        t0 = time.perf_counter()
        # On a 2-core AVX2 EPYC the int4 kernel halves on 2 threads and a float32 GEMM of a few rows,
        # bound by memory, does not: int4 won up to 8 rows on one thread, ~30 on two.
        with on_every_core():
            for attempt in range(1, _PLAN_ATTEMPTS + 1):
                plan = measure_int4_plan(shape, bf16_fast, copy_params)
                if plan.max_int4_rows > 0 or not layout_matches() or attempt == _PLAN_ATTEMPTS:
                    break
                log.info("int4 linear plan measured again (attempt %d said: %s)", attempt, plan.reason)
            _PLANS[key] = plan
        log.info("int4 linear plan (measured in %.2f s): %s", time.perf_counter() - t0, plan.reason)
    return _PLANS[key]
