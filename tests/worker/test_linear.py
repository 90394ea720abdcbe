"""Linear kernels (evenflow/worker/models/linear.py): every kernel computes F.linear, the packed one is
chosen for float32 on CPU when this torch build has it, and a build without it falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from evenflow.worker.models import linear as linear_module
from evenflow.worker.models.linear import PackedCpuLinear, TorchLinear, UpcastCpuLinear, pick_linear

CPU = torch.device("cpu")


@pytest.mark.parametrize("kernel", [TorchLinear(), UpcastCpuLinear(), PackedCpuLinear()])
@pytest.mark.parametrize("rows", [1, 2, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernels_compute_f_linear(kernel: TorchLinear, rows: int, with_bias: bool) -> None:
    if isinstance(kernel, PackedCpuLinear) and not PackedCpuLinear.works():
        pytest.skip("this torch build has no oneDNN packed linear")
    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g), torch.randn(96, generator=g)
    bias = b if with_bias else None
    out = kernel(x, kernel.prepare(w), bias)
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-4, rtol=1e-4)


def test_pick_linear_by_dtype_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(pick_linear(torch.float32, torch.device("cuda")), TorchLinear)
    assert isinstance(pick_linear(torch.float32, CPU, packed=False), TorchLinear)
    monkeypatch.setattr(linear_module, "_cpu_flags", lambda: {"avx2"})
    assert isinstance(pick_linear(torch.bfloat16, CPU), UpcastCpuLinear)
    monkeypatch.setattr(linear_module, "_cpu_flags", lambda: {"avx512_bf16"})
    native_bf16 = PackedCpuLinear if PackedCpuLinear.works(torch.bfloat16) else TorchLinear
    assert type(pick_linear(torch.bfloat16, CPU)) is native_bf16
    assert type(pick_linear(torch.bfloat16, CPU, packed=False)) is TorchLinear
    if torch.backends.mkldnn.is_available():  # the CPU wheels CI installs have oneDNN
        assert isinstance(pick_linear(torch.float32, CPU), PackedCpuLinear)


def test_missing_onednn_ops_fall_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("no such op")

    monkeypatch.setattr(PackedCpuLinear, "prepare", lambda self, w: missing())
    assert not PackedCpuLinear.works()
    assert type(pick_linear(torch.float32, CPU)) is TorchLinear


def test_packed_model_releases_loaded_weights_but_keeps_the_embedding(tiny_llama: Path) -> None:
    from tests.worker.harness import make_runner

    runner = make_runner(tiny_llama, num_blocks=16)
    model = runner.model
    if not isinstance(model.linear, PackedCpuLinear):
        pytest.skip("this torch build has no oneDNN packed linear")
    for layer in model.layers:
        assert layer.qkv.numel() == layer.o.numel() == layer.gate_up.numel() == layer.down.numel() == 0
    assert model.embed.numel() == model.cfg.vocab_size * model.cfg.hidden_size
