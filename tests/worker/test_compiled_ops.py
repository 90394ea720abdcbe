"""The compiled elementwise groups (evenflow/worker/models/compiled_ops.py): the same math as the eager
ops, one graph for every row count (nothing compiles after start-up), and only where the model runs the
narrowing path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import gguf

from evenflow.core.component_configs import worker_template
from evenflow.core.engine_config import config_from_args
from evenflow.worker.models.compiled_ops import (
    COMPILE_MIN_ROWS, CompiledOps, add_norm, compile_layer_ops, rotary_qk, swiglu,
)
from evenflow.worker.models.int4_linear import EVERY_ROW, Int4Plan
from evenflow.worker.models.linear import cpu_has_fast_path
from evenflow.worker.runner import ModelRunner
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.real.scoring import score
from tests.worker.harness import make_runner

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
QK_END = (HEADS + KV_HEADS) * HEAD_DIM
QKV = QK_END + KV_HEADS * HEAD_DIM
pytestmark = pytest.mark.timeout(600)  # one cold inductor compile of three small graphs


@pytest.fixture(scope="module")
def ops() -> CompiledOps:
    ops = CompiledOps(32, HIDDEN, QKV, QK_END, HEAD_DIM, INTER, torch.bfloat16, torch.bfloat16, torch.float32)
    ops.warm_up()
    return ops


def _inputs(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    angles = torch.rand(rows, 1, HEAD_DIM // 2, generator=g) * 6.28
    return {
        "x": torch.randn(rows, HIDDEN, generator=g), "delta": torch.randn(rows, HIDDEN, generator=g).bfloat16(),
        "scaled": torch.rand(HIDDEN, generator=g) + 0.5, "eps_root": torch.tensor(1e-3),
        "qkv": torch.randn(rows, QKV, generator=g).bfloat16(), "gu": torch.randn(rows, 2 * INTER, generator=g).bfloat16(),
        "cos": torch.cat((angles.cos(), angles.cos()), -1), "sin": torch.cat((-angles.sin(), angles.sin()), -1),
    }


@pytest.mark.parametrize("rows", [32, 77, 600])
def test_compiled_groups_compute_what_the_eager_ops_do(ops: CompiledOps, rows: int) -> None:
    a = _inputs(rows)
    x_eager, x_compiled = a["x"].clone(), a["x"].clone()
    with torch.inference_mode():
        h_eager = add_norm(x_eager, a["delta"], a["scaled"], a["eps_root"], torch.bfloat16)
        h_compiled = ops.add_norm(x_compiled, a["delta"], a["scaled"], a["eps_root"])
        qk_eager = rotary_qk(a["qkv"], a["cos"], a["sin"], QK_END, HEAD_DIM, torch.bfloat16)
        qk_compiled = ops.rotary_qk(a["qkv"], a["cos"], a["sin"])
        sw_eager, sw_compiled = swiglu(a["gu"], INTER, torch.bfloat16), ops.swiglu(a["gu"])
    torch.testing.assert_close(x_compiled, x_eager)  # the residual stream, added in place
    assert h_compiled.dtype == qk_compiled.dtype == sw_compiled.dtype == torch.bfloat16
    assert qk_compiled.shape == (rows, HEADS + KV_HEADS, HEAD_DIM)
    # bfloat16 outputs: a fused graph rounds once where the eager ops round after each op
    for got, want in ((h_compiled, h_eager), (qk_compiled, qk_eager), (sw_compiled, sw_eager)):
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def test_no_row_count_compiles_after_the_warm_up() -> None:
    """Inputs as a step has them: weights plain tensors, activations made under inference mode."""
    ops = CompiledOps(32, HIDDEN, QKV, QK_END, HEAD_DIM, INTER, torch.bfloat16, torch.bfloat16, torch.float32)
    ops.warm_up()
    before = sum(counters["frames"].values())
    weights = _inputs(1)
    for rows in (33, 300, 2048):
        with torch.inference_mode():
            a = _inputs(rows)
            ops.add_norm(a["x"], a["delta"], weights["scaled"], weights["eps_root"])
            ops.rotary_qk(a["qkv"], a["cos"], a["sin"])
            ops.swiglu(a["gu"])
    assert sum(counters["frames"].values()) == before


def test_no_thread_count_of_the_plan_compiles_after_the_warm_up() -> None:
    """Dynamo guards on the thread count: a step on a count the warm-up did not compile for (the thread
    rule's fallback while a core is taken) compiled in the step, 5.2 s served."""
    ops = CompiledOps(32, HIDDEN, QKV, QK_END, HEAD_DIM, INTER, torch.bfloat16, torch.bfloat16, torch.float32)
    current = torch.get_num_threads()
    ops.warm_up((1, 2))
    assert torch.get_num_threads() == current
    before = sum(counters["frames"].values())
    weights = _inputs(1)
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                a = _inputs(300)
                ops.add_norm(a["x"], a["delta"], weights["scaled"], weights["eps_root"])
                ops.rotary_qk(a["qkv"], a["cos"], a["sin"])
                ops.swiglu(a["gu"])
    finally:
        torch.set_num_threads(current)
    assert sum(counters["frames"].values()) == before
    torch.set_num_threads(3 if current != 3 else 4)  # a count it was not compiled for: the guard is real
    try:
        with torch.inference_mode():
            ops.swiglu(_inputs(300)["gu"])
    finally:
        torch.set_num_threads(current)
    assert sum(counters["frames"].values()) > before


def test_rows_below_the_threshold_stay_eager(ops: CompiledOps) -> None:
    assert not ops.takes(31) and ops.takes(32) and ops.takes(4096)


def test_a_float32_model_is_not_compiled(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=16)
    assert compile_layer_ops(runner.model, 32).startswith("eager")
    assert runner.model.compiled_ops is None


def test_enforce_eager_reaches_the_workers(tiny_llama: Path) -> None:
    for argv, expected in (([], False), (["--enforce-eager"], True)):
        cfg = config_from_args(["--model", str(tiny_llama), *argv])
        assert cfg.enforce_eager is expected
        assert worker_template(cfg, str(tiny_llama), 512).enforce_eager is expected


def _q4_runner(checkpoint_root: Path, tmp_path: Path, **checkpoint: object) -> ModelRunner:
    model = make_checkpoint(checkpoint_root, **checkpoint)
    name = f"{checkpoint.get('model_type', 'llama')}-q4_1.gguf"
    return make_runner(write_gguf(model, tmp_path / name, gguf.GGMLQuantizationType.Q4_1), num_blocks=64,
                       quantization="gguf")


def _assert_a_long_step_compiles_nothing(runner: ModelRunner) -> None:
    before = sum(counters["frames"].values())
    prompt = [(7 * i) % 250 + 1 for i in range(COMPILE_MIN_ROWS + 44)]
    score(runner, prompt, len(prompt))
    assert sum(counters["frames"].values()) == before


@pytest.mark.parametrize(("plan", "done"), [
    # int4 to 256 rows (bfloat16), a float32 dense path above: the graphs would be the dense path's alone
    (Int4Plan(COMPILE_MIN_ROWS, torch.float32, "test"), f"eager ({COMPILE_MIN_ROWS + 1}-row steps compute in float32"),
    # int4 at every row count (evenflow's GEMV won past the probes): no dense path runs, the graphs are bfloat16
    (Int4Plan(EVERY_ROW, torch.float16, "test"), f"compiled for steps of {COMPILE_MIN_ROWS}+ rows"),
])
def test_the_graphs_take_the_dtype_of_the_rows_past_the_threshold(checkpoint_root: Path, tmp_path: Path,
                                                                     plan: Int4Plan, done: str) -> None:
    """The graphs take one activation dtype: that of the rows they serve, past the threshold and past the int4
    plan's rows where those compute in another; a longer step then compiles nothing again."""
    runner = _q4_runner(checkpoint_root, tmp_path, seed=5)
    runner.model.linear.plan = plan
    said = compile_layer_ops(runner.model, COMPILE_MIN_ROWS, bf16_native=True)
    assert said.startswith(done), said
    _assert_a_long_step_compiles_nothing(runner)


def test_without_native_bfloat16_the_glue_takes_the_steps_uncompiled(checkpoint_root: Path, tmp_path: Path) -> None:
    runner = _q4_runner(checkpoint_root, tmp_path, seed=5)
    runner.model.linear.plan = Int4Plan(EVERY_ROW, torch.float16, "test")
    assert compile_layer_ops(runner.model, COMPILE_MIN_ROWS, bf16_native=False).startswith("eager (no native")
    assert runner.model.compiled_ops is None


def test_a_qkv_bias_compiles_nothing_after_the_warm_up(checkpoint_root: Path, tmp_path: Path) -> None:
    """Qwen2's float32 qkv bias widens the bfloat16 qkv product: the warm-up compiles the rotary group for
    that dtype, so a long step of such a model does not compile it again while requests wait."""
    if not cpu_has_fast_path(torch.bfloat16):
        pytest.skip("4-bit weights compute in float32 on this CPU: no narrowing path to compile")
    runner = _q4_runner(checkpoint_root, tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], seed=3)
    model = runner.model
    assert model._linears[0].qkv_bias is not None
    model.linear.plan = Int4Plan(4, torch.bfloat16, "test")  # many-row steps in bfloat16, whatever start-up chose
    assert compile_layer_ops(model, COMPILE_MIN_ROWS, bf16_native=True).startswith("compiled")
    _assert_a_long_step_compiles_nothing(runner)
