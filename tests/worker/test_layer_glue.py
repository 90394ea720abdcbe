"""The C++ elementwise groups of few-row steps (evenflow/worker/models/layer_glue.py): the same values as
the eager ops (models/compiled_ops.py's functions) within one bfloat16 rounding, on strided rows and widths
that leave vector tails, on one thread and on the pool; taken only where every projection computes in
bfloat16 under the model's kernel and its live plan; the eager ops where the kernel does not build; and a
served model's logits with them track those without."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import gguf
import pytest
import torch
from evenflow.worker.models.compiled_ops import add_norm, rotary_qk, swiglu
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan
from evenflow.worker.models.layer_glue import LayerGlue, attach_layer_glue
from evenflow.worker.models.linear import cpu_has_fast_path, pick_linear
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.real.scoring import score
from tests.worker.harness import make_runner

BF16_ULP = 2.0**-7  # the widest relative spacing of bfloat16 values: one rounding apart


def _glue(qk_heads: int, head_dim: int, inter: int) -> LayerGlue:
    glue = LayerGlue.build(qk_heads, head_dim, inter)
    if glue is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")
    return glue


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 1200])  # 1200: large enough for the thread pool
@pytest.mark.parametrize(("hidden", "head_dim", "inter"), [(72, 64, 100), (92, 128, 120), (576, 80, 1536)])
def test_groups_compute_what_the_eager_ops_do(rows: int, hidden: int, head_dim: int, inter: int) -> None:
    heads, kv_heads = 3, 1  # 72, 92, 100, 120 and head_dim 80 leave vector tails, whole and half
    qk_end = (heads + kv_heads) * head_dim
    glue = _glue(heads + kv_heads, head_dim, inter)
    g = torch.Generator().manual_seed(rows + hidden)
    # Rows inside wider buffers: the kernels take row strides as the model's slices have them.
    stream = torch.randn(rows, hidden + 8, generator=g) * 3
    delta = torch.randn(rows, hidden + 16, generator=g).bfloat16()[:, 3 : 3 + hidden]
    scaled, eps_root = torch.rand(hidden, generator=g) * 9, torch.tensor(0.03)
    qkv = torch.randn(rows, qk_end + kv_heads * head_dim + 5, generator=g).bfloat16()
    gu = torch.randn(rows, 2 * inter + 7, generator=g).bfloat16()[:, : 2 * inter]
    angles = torch.rand(rows, 1, head_dim // 2, generator=g) * 6.28
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    with torch.inference_mode():
        x_eager, x_glue = stream.clone()[:, :hidden], stream.clone()[:, :hidden]
        want_norm = add_norm(x_eager, delta, scaled, eps_root, torch.bfloat16)
        _close(glue.add_norm(x_glue, delta, scaled, eps_root), want_norm)
        torch.testing.assert_close(x_glue, x_eager, rtol=0, atol=0)  # the residual stream, added in place
        _close(glue.rotary_qk(qkv, cos, sin), rotary_qk(qkv, cos, sin, qk_end, head_dim, torch.bfloat16))
        # SwiGLU rounds once, as inductor's fused graph does; the eager ops round silu's output first.
        want = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).bfloat16()
        _close(glue.swiglu(gu), want)
        _close(glue.swiglu(gu), swiglu(gu, inter, torch.bfloat16))


def test_taken_only_for_steps_whose_projections_compute_in_bfloat16() -> None:
    linear = Int4CpuLinear(pick_linear(torch.float32, torch.device("cpu")), Int4Plan(8, torch.float32, "test"))
    assert LayerGlue.takes(linear, 1) and LayerGlue.takes(linear, 8) and not LayerGlue.takes(linear, 9)
    linear.plan = Int4Plan(8, torch.bfloat16, "test")  # read live: a plan changed later is followed
    assert LayerGlue.takes(linear, 9) and LayerGlue.takes(linear, 4096)
    # A model whose kernel was swapped for another (a probe's) computes in its own dtype: not taken.
    assert not LayerGlue.takes(linear.dense, 1)


def test_a_kernel_that_does_not_build_leaves_the_eager_ops() -> None:
    with patch("evenflow.worker.models.layer_glue.load_cpp", return_value=None):
        assert LayerGlue.build(4, 64, 96) is None


def test_a_float32_model_gets_no_glue(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=16)
    assert attach_layer_glue(runner.model).startswith("eager") and runner.model.layer_glue is None


@pytest.fixture(scope="module")
def q4_gguf(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-glue")
    return write_gguf(make_checkpoint(checkpoint_root, seed=7), out / "llama-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)


def test_served_logits_with_the_glue_track_those_without(q4_gguf: Path) -> None:
    if not cpu_has_fast_path(torch.bfloat16):
        pytest.skip("4-bit weights compute in float32 on this CPU: the narrowing path, and the glue, are off")
    runner = make_runner(q4_gguf, num_blocks=16, quantization="gguf")
    glue = runner.model.layer_glue
    assert glue is not None, "the narrowing path's start-up attaches the glue"
    runner.model.layer_glue = None
    with patch("evenflow.worker.models.layer_glue.load_cpp", return_value=None):
        assert attach_layer_glue(runner.model) == "eager (the C++ kernel did not build)"
    assert runner.model.layer_glue is None
    runner.model.layer_glue = glue
    runner.model.linear.plan = Int4Plan(4, torch.float32, "test")  # 4-row chunks on the int4 kernel
    prompt = [1, 17, 250, 9, 33, 101, 64, 7, 200, 3, 45, 88, 12, 190, 66, 5]
    with_glue = score(runner, prompt, 4)
    runner.model.layer_glue = None
    try:
        eager = score(runner, prompt, 4)
    finally:
        runner.model.layer_glue = glue
    scale = float(eager.logits.abs().max())
    diff = (with_glue.logits - eager.logits).abs()
    # Only SwiGLU rounds differently (once, not twice): bfloat16-sized differences, carried through the layers.
    assert float(diff.max()) <= 0.02 * scale and float(diff.mean()) <= 0.002 * scale, (diff.max(), diff.mean(), scale)
    assert abs(with_glue.perplexity / eager.perplexity - 1) <= 0.01
