"""The int4 linear (evenflow/worker/models/int4_linear.py, q4_blocks.py): GGUF Q4_0/Q4_1 blocks packed
for torch's CPU int4 kernel hold exactly the values gguf's own dequantizer gives, and both of the
kernel's paths (int4 for few rows, dequantized dense for many) compute the linear of those values."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from evenflow.worker.models.fp16_gemm import fp16_gemm_works
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan, layout_matches, measure_int4_plan, packed_kernel
from evenflow.worker.models.linear import TorchLinear
from evenflow.worker.models.q4_blocks import concat_rows, pack, split_blocks

Q4_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
# bfloat16 activations (8 significant bits) and bfloat16 group scales: both paths' outputs are within
# this fraction of the output's largest magnitude of the float32 linear on gguf's values.
BF16_REL_TOL = 2e-2


def blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Raw GGUF blocks of a random weight and gguf's float32 dequantization of them (the reference)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).copy())


def test_this_torch_packs_int4_in_the_layout_evenflow_reads() -> None:
    assert layout_matches()


# Packs and unpacks a GGUF Q4_1 weight in a process whose ATen runs the named ISA's kernels.
_UNPACK_UNDER_ISA = """
import json, numpy as np, torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from evenflow.worker.models.int4_linear import layout_matches
from evenflow.worker.models.q4_blocks import pack, pack_tile_rows, split_blocks
w = (np.random.default_rng(0).standard_normal((192, 576)) * 0.05).astype(np.float32)
raw = quantize(w, T.Q4_1)
ref = torch.from_numpy(dequantize(raw, T.Q4_1).reshape(w.shape).copy())
ok = layout_matches()
err = float((pack(split_blocks(T.Q4_1, raw, w.shape)).dequantize(torch.empty(w.shape)) - ref).abs().max()) if ok else None
print(json.dumps({"rows": pack_tile_rows(), "layout": ok, "err": err, "bound": float(ref.abs().max()) * 2**-7}))
"""


@pytest.mark.parametrize("isa, tile_rows", [("avx512", 64), ("avx2", 32), ("default", None)])
def test_every_isas_int4_layout_is_read_or_refused(isa: str, tile_rows: int | None) -> None:
    """torch packs int4 in 64-row tiles on AVX-512 and 32-row ones on AVX2 (which one is the CPU's, not
    the build's): each is read back to GGUF's values; the scalar layout is refused, not misread."""
    env = {"ATEN_CPU_CAPABILITY": isa, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _UNPACK_UNDER_ISA], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["rows"] == tile_rows and got["layout"] == (tile_rows is not None)
    if tile_rows is not None:
        assert got["err"] <= got["bound"]


@pytest.mark.parametrize("qtype", Q4_TYPES)
@pytest.mark.parametrize("shape", [(64, 32), (192, 576), (128, 1536)])
def test_packed_blocks_hold_ggufs_values(qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    raw, reference = blocks(qtype, *shape, seed=shape[1])
    rows = split_blocks(qtype, raw, shape)
    torch.testing.assert_close(rows.values(), reference, rtol=1e-6, atol=1e-7)
    # The packed form's scale and zero are bfloat16, as the kernel reads them: values within bf16 rounding.
    unpacked = pack(rows).dequantize(torch.empty(shape))
    torch.testing.assert_close(unpacked, reference, rtol=0, atol=float(reference.abs().max()) * 2**-7)


def test_fused_parts_keep_their_rows_in_order() -> None:
    (raw_a, ref_a), (raw_b, ref_b) = blocks(Q4_TYPES[1], 128, 64, 1), blocks(Q4_TYPES[0], 64, 64, 2)
    fused = concat_rows([split_blocks(Q4_TYPES[1], raw_a, (128, 64)), split_blocks(Q4_TYPES[0], raw_b, (64, 64))])
    torch.testing.assert_close(fused.values(), torch.cat([ref_a, ref_b]), rtol=1e-6, atol=1e-7)


def test_other_types_and_partial_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit type"):
        split_blocks(GGMLQuantizationType.Q8_0, np.zeros((1, 34), np.uint8), (1, 32))
    with pytest.raises(ValueError, match="multiple of the 32-value block"):
        split_blocks(GGMLQuantizationType.Q4_1, np.zeros((1, 20), np.uint8), (1, 48))


@pytest.mark.parametrize("qtype", Q4_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 40, 300])
@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_paths_compute_the_linear_of_the_gguf_values(qtype: GGMLQuantizationType, rows: int,
                                                          dense_dtype: torch.dtype) -> None:
    raw, reference = blocks(qtype, 192, 576, seed=rows)
    weight = pack(split_blocks(qtype, raw, (192, 576)))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(192)
    expect = F.linear(x, reference, bias)
    # The packed weight's own values (GGUF's, scales rounded to bfloat16): the float32 dense path is exact on them.
    exact = F.linear(x, weight.dequantize(torch.empty(192, 576)), bias)
    for max_int4_rows in (0, 8):  # every row count through the dense path, then the int4 path up to 8
        kernel = Int4CpuLinear(TorchLinear(), Int4Plan(max_int4_rows, dense_dtype, "test"))
        out = kernel(x, weight, bias)
        assert out.dtype == torch.float32 and out.shape == expect.shape
        assert float((out - expect).abs().max()) <= BF16_REL_TOL * float(expect.abs().max())
        if max_int4_rows < rows and dense_dtype != torch.bfloat16:  # float16 without its copy: float32
            torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not fp16_gemm_works(), reason="this torch has no FBGEMM float16 GEMM")
def test_a_float16_copy_computes_the_linear_of_the_values_rounded_to_float16() -> None:
    raw, _ = blocks(GGMLQuantizationType.Q4_1, 192, 576, seed=5)
    weight = pack(split_blocks(GGMLQuantizationType.Q4_1, raw, (192, 576)))
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5))
    kernel = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.float16, "test", dense_copy=True))
    copied = kernel.laid_out(weight)
    assert isinstance(copied.dense, torch.ScriptObject) and copied.nbytes == weight.nbytes
    assert kernel.act_dtype(copied, 40) == torch.float32 and kernel.act_dtype(copied, 8) == torch.bfloat16
    values = weight.dequantize(torch.empty(192, 576))
    out = kernel(x, copied)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ values.half().float().T, rtol=1e-4, atol=1e-4)
    assert not torch.equal(values.half().float(), values)  # the rounding is real, and the copy computes it
    int4_only = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.float32, "test"))
    assert torch.equal(kernel(x[:8], copied), int4_only(x[:8], weight))  # up to 8 rows: int4, the copy unread
    assert kernel.step_nbytes(copied, 8) == weight.nbytes and kernel.step_nbytes(copied, 9) == 192 * 576 * 2

@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
def test_a_dense_copy_computes_what_dequantizing_per_step_does(dense_dtype: torch.dtype) -> None:
    raw, _ = blocks(GGMLQuantizationType.Q4_1, 192, 576, seed=7)
    weight = pack(split_blocks(GGMLQuantizationType.Q4_1, raw, (192, 576)))
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(7))
    per_step = Int4CpuLinear(TorchLinear(), Int4Plan(8, dense_dtype, "test"))
    copying = Int4CpuLinear(TorchLinear(), Int4Plan(8, dense_dtype, "test", dense_copy=True))
    copied = copying.laid_out(weight)
    assert per_step.laid_out(weight) is weight and weight.dense is None
    assert copied.dense is not None and copied.dense.dtype == dense_dtype and copied.nbytes == weight.nbytes
    got, want = copying(x, copied), per_step(x, weight)  # above 8 rows: the copy's GEMM
    if copied.dense.is_mkldnn:  # laid out for oneDNN: the same values, summed in the packed kernel's order
        assert packed_kernel(dense_dtype) is not None
        torch.testing.assert_close(got, want, **({"rtol": 1e-5, "atol": 1e-5} if dense_dtype == torch.float32 else {}))
    else:
        assert packed_kernel(dense_dtype) is None and torch.equal(got, want)
    assert torch.equal(copying(x[:8], copied), per_step(x[:8], weight))  # up to 8: int4, the copy unread
    # A plan swapped to another dense dtype (as the accuracy tests do) dequantizes instead of reading it.
    other = torch.float32 if dense_dtype == torch.bfloat16 else torch.bfloat16
    copying.plan = per_step.plan = Int4Plan(8, other, "test")
    assert torch.equal(copying(x, copied), per_step(x, weight))


def test_dense_weights_pass_through_to_the_wrapped_kernel() -> None:
    kernel = Int4CpuLinear(TorchLinear(), Int4Plan(8, torch.bfloat16, "test"))
    w, x = torch.randn(24, 40), torch.randn(2, 40)
    torch.testing.assert_close(kernel(x, kernel.prepare(w)), F.linear(x, w))


def test_start_up_plan_is_measured_and_explained() -> None:
    plan = measure_int4_plan((128, 256), bf16_fast=True)
    assert plan.max_int4_rows >= 0 and plan.dense_dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert "1: int4" in plan.reason  # every probe's timings are in the logged reason


def test_the_plan_keeps_a_dense_copy_only_where_it_fits() -> None:
    fits = measure_int4_plan((128, 256), bf16_fast=True, copy_params=10 * 128 * 256, available_bytes=1 << 34)
    assert " copy " in fits.reason  # the copy was timed at every probe size
    assert fits.dense_copy == any(f"a {kind} copy above" in fits.reason
                                  for kind in ("bfloat16", "float32", "float16 (FBGEMM)"))
    assert ("float16 copy " in fits.reason) == fp16_gemm_works()  # timed wherever the kernel exists
    tight = measure_int4_plan((128, 256), bf16_fast=True, copy_params=10 * 128 * 256, available_bytes=1 << 20)
    assert not tight.dense_copy
    assert all(f"{kind} copy " not in tight.reason for kind in ("float32", "bfloat16", "float16"))  # none timed
    assert tight.max_int4_rows == 0 or tight.every_row or "would not fit" in tight.reason


@pytest.mark.parametrize(("wins_beyond", "loses_last_probe"), [(True, False), (False, False), (True, True)])
def test_a_gemv_winning_past_the_probes_takes_every_row_count(monkeypatch: pytest.MonkeyPatch, wins_beyond: bool,
                                                              loses_last_probe: bool) -> None:
    """evenflow's GEMV that wins the probes (the last one too, or up to the one before it: a near tie there) is
    timed once more at ``_CONFIRM_ROWS`` rows against the dense path: winning there it takes every row count and
    no dense copy is kept; losing, the plan stops at the probes."""
    from evenflow.worker.models import int4_linear

    if int4_linear.load_int4_gemv() is None:
        pytest.skip("no int4 GEMV on this CPU")
    calls = []

    def timings(fns: list, trials: int = 5) -> list[float]:  # the GEMV is each probe's last, the check's first
        calls.append(len(fns))
        if trials == 2:
            return [0.1, 1.0] if wins_beyond else [1.0, 0.1]
        last_probe = len(calls) == 1 + len(int4_linear._PROBE_ROWS)  # after the dtype costs' call
        return [1.0] * (len(fns) - 1) + [2.0 if loses_last_probe and last_probe else 0.1]

    monkeypatch.setattr(int4_linear, "time_min", timings)
    plan = measure_int4_plan((128, 256), bf16_fast=False, copy_params=10 * 128 * 256, available_bytes=1 << 34)
    assert f"{int4_linear._CONFIRM_ROWS} rows: GEMV" in plan.reason
    assert plan.every_row == wins_beyond and plan.takes_int4(1 << 20) == wins_beyond
    assert calls[-1] == 2  # the check ran
    assert plan.gemv_rows.first == 1 and plan.gemv_rows.last == (int4_linear.EVERY_ROW if wins_beyond else 256)
    if wins_beyond:
        assert not plan.dense_copy and plan.reason.startswith("int4 at every row count")
    else:
        assert plan.max_int4_rows == 256


def test_a_verdict_that_int4_never_wins_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from evenflow.worker.models import int4_linear

    good = Int4Plan(8, torch.float32, "int4 up to 8 rows")
    bad = Int4Plan(0, torch.float32, "the int4 kernel was slower than float32 at one row")
    answers = [bad, good]
    monkeypatch.setattr(int4_linear, "_PLANS", {})
    monkeypatch.setattr(int4_linear, "layout_matches", lambda: True)
    monkeypatch.setattr(int4_linear, "measure_int4_plan", lambda *_: answers.pop(0))
    assert int4_linear.int4_plan((64, 64), False, 11) is good and not answers  # a busy moment, then the truth
    answers[:] = [bad] * 5
    assert int4_linear.int4_plan((64, 64), False, 12) is bad and len(answers) == 5 - int4_linear._PLAN_ATTEMPTS
    answers[:] = [good, bad]
    assert int4_linear.int4_plan((64, 64), False, 13) is good and answers == [bad]  # a plan that wins: once
