"""rms_norm_narrowing (the int4 path's RMSNorm into bfloat16) against rms_norm: the same values up to
the narrowing cast, a zero row stays zero (eps is kept), and the float32 path keeps F.rms_norm."""

from __future__ import annotations

import math

import pytest
import torch
from evenflow.worker.models.layers import rms_norm, rms_norm_narrowing


@pytest.mark.parametrize("rows", [1, 7])
def test_narrowing_norm_matches_rms_norm_within_bf16_rounding(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden, eps = 576, 1e-5
    x = torch.randn(rows, hidden, generator=g) * 3
    x[0] = 0.0  # eps keeps it finite: zeros, as rms_norm gives
    weight = torch.randn(hidden, generator=g)
    root = torch.tensor(math.sqrt(hidden * eps))
    got = rms_norm_narrowing(x, weight * math.sqrt(hidden), root, torch.bfloat16)
    want = rms_norm(x, weight, eps)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[0].float(), torch.zeros(hidden))
    torch.testing.assert_close(got.float(), want, rtol=2.0 ** -8, atol=1e-6)
