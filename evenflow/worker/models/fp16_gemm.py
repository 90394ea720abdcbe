"""FBGEMM's float16-weight GEMM: float32 activations and accumulation against weights stored as
float16, converted in registers (F16C), from a layout packed once.

It is the int4 plan's dense copy for many-row steps where the CPU has no native bf16 (AVX2): the
copy is half the bytes of a float32 one and the GEMM faster at every row count. On a 2-core AVX2
EPYC (576 -> 3072, 2 threads, each weight read from memory, ms): 8 rows 0.34 against float32 1.18
and int4 0.45; 32 rows 0.90 / 1.84 / 1.74; 128 rows 3.1 / 5.1; 512 rows 12.0 / 14.0. Its values are
the float32 product of the weights rounded to float16 (a relative 2^-11, where bfloat16 rounds to
2^-8), so the many-row path is closer to the float32 reference than the int4 kernel's bf16 inputs.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

log = logging.getLogger("evenflow.worker.fp16_gemm")

_PREPACK = getattr(getattr(torch.ops.quantized, "linear_prepack_fp16", None), "default", None)
_LINEAR = getattr(getattr(torch.ops.quantized, "linear_dynamic_fp16", None), "default", None)


def pack_fp16(weight: torch.Tensor) -> torch.ScriptObject:
    """``weight`` [out, in] (float32) rounded to float16 and packed for ``fp16_linear``."""
    assert _PREPACK is not None
    return _PREPACK(weight.float().contiguous(), None)


def fp16_linear(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``x`` [rows, in] float32 times the packed weight, float32 [rows, out]."""
    assert _LINEAR is not None
    return _LINEAR(x.contiguous(), packed)


@cache
def fp16_gemm_works() -> bool:
    """Whether this torch has FBGEMM's float16 GEMM and it computes the float16-rounded product
    (a build without FBGEMM, or a torch that drops the op, keeps the plan to the other paths)."""
    if _PREPACK is None or _LINEAR is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g)
        got = fp16_linear(x, pack_fp16(w))
        want = x @ w.half().float().T
        return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    except RuntimeError as exc:
        log.info("FBGEMM float16 GEMM unavailable (%s)", exc)
        return False
