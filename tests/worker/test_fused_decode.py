"""Every layer of a decode step in one C++ call (evenflow/worker/models/fused_decode.py): the same bits as the
Python layer loop with the layer glue (logits and every K/V written), on blocks out of order, at 1 to 6
rows, on torch's int4 kernel, evenflow's int4 GEMV and dense copies, at both thread counts, on two shapes; taken only for decode
steps the glue and the decode kernel take; served greedy tokens unchanged; a step the C++ refuses raises
instead of writing outside the cache; and where it is off, the start-up log says why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import gguf
import numpy as np
import pytest
import torch
from evenflow.worker.models.fused_decode import FusedDecode, attach_fused_decode
from evenflow.worker.models.int4_gemv import NO_GEMV, GemvRows, load_int4_gemv
from evenflow.worker.models.int4_linear import Int4Plan
from evenflow.worker.models.linear import PackedCpuLinear
from evenflow.worker.runner import ModelRunner
from evenflow.worker.synthetic_steps import SyntheticStep, synthetic_step
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.worker.harness import Job, greedy, make_runner, run_jobs

# Shapes at a size the tests run fast, every projection filling the int4 kernel's 64-row tiles: SmolLM2's
# heads (head_dim 64, 3 query heads a KV head), and one whose widths all differ (hidden, intermediate,
# query and KV widths) so that a width read for another shows.
SHAPES = {
    "smollm2 heads": dict(hidden_size=192, intermediate_size=192, num_hidden_layers=3, num_attention_heads=3,
                          num_key_value_heads=1, head_dim=64),
    "distinct widths": dict(hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64),
}


@pytest.fixture(scope="module")
def q4_ggufs(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-fused")
    return {name: write_gguf(make_checkpoint(checkpoint_root, seed=11, **shape), out / f"fused-{i}-q4_1.gguf",
                             gguf.GGMLQuantizationType.Q4_1) for i, (name, shape) in enumerate(SHAPES.items())}


@pytest.fixture(scope="module")
def q4_gguf(q4_ggufs: dict[str, Path]) -> Path:
    return q4_ggufs["smollm2 heads"]


def _fused_runner(model: Path, num_blocks: int = 96) -> ModelRunner:
    # Up to 6 rows on the int4 kernels (evenflow's GEMV where it runs here, its weights laid out for it at load),
    # more on dense bfloat16 copies made at load where oneDNN packs them (native bfloat16), else dequantized.
    copies = PackedCpuLinear.works(torch.bfloat16)
    gemv = GemvRows(1, 6) if load_int4_gemv() is not None else NO_GEMV
    plan = Int4Plan(6, torch.bfloat16 if copies else torch.float32, "test", copies, gemv_rows=gemv)
    with patch("evenflow.worker.models.llama.int4_plan", lambda *_: plan):
        runner = make_runner(model, num_blocks=num_blocks, block_size=16, quantization="gguf")
    if runner.model.layer_glue is None:
        pytest.skip("4-bit weights compute in float32 on this CPU: the narrowing path, and the glue, are off")
    if runner.model.fused_decode is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")
    assert runner.model.fused_decode.dense_copies == copies
    return runner


def _shuffled(step: SyntheticStep, num_blocks: int, seed: int) -> SyntheticStep:
    """``step`` with its blocks at other ids, out of order (a served cache's blocks are seldom a range)."""
    perm = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
    a = step.attn
    table = perm[a.block_table_np]
    slots_np = a.slot_mapping.numpy()
    slots = perm[slots_np // a.block_size].astype(np.int64) * a.block_size + slots_np % a.block_size
    attn = replace(a, block_table=torch.from_numpy(table), block_table_np=table, slot_mapping=torch.from_numpy(slots))
    return replace(step, attn=attn)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[40], [70, 33, 17], [200, 5, 64, 129, 31, 90]])
@pytest.mark.parametrize("kernel", ["int4", "gemv", "dense copies"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_fused_step_gives_the_python_loops_bits(q4_ggufs: dict[str, Path], shape: str, lens: list[int],
                                                  threads: int, kernel: str) -> None:
    runner = _fused_runner(q4_ggufs[shape])
    model, fused = runner.model, runner.model.fused_decode
    if kernel == "dense copies":
        if not fused.dense_copies:
            pytest.skip("no dense bfloat16 copies on this CPU (oneDNN packs them only with native bfloat16)")
        model.linear.plan = Int4Plan(0, torch.bfloat16, "test", True)  # every row count on the copies
    elif kernel == "gemv":
        if load_int4_gemv() is None:
            pytest.skip("evenflow's int4 GEMV does not run on this CPU (neither AVX-512 BF16 and VBMI nor AVX2)")
    else:
        model.linear.plan = replace(model.linear.plan, gemv_rows=NO_GEMV)  # torch's int4 kernel
    assert model.linear.kernel(len(lens)) == {"dense copies": "dense"}.get(kernel, kernel)
    step = _shuffled(synthetic_step([1] * len(lens), lens, runner.block_size, runner.device), 96, len(lens))
    g = torch.Generator().manual_seed(len(lens))
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ids = torch.randint(0, 256, (len(lens),), generator=g)
    plan = runner.attn.plan(step.attn)
    assert fused.takes(plan, len(lens), model.layer_glue, model.linear)

    def forward(with_fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        model.fused_decode = fused if with_fused else None
        try:
            with torch.inference_mode():
                logits = model(ids, step.positions, runner.kv_caches, runner.attn, plan, step.logits_indices)
        finally:
            model.fused_decode = fused
        return logits, [c.clone() for kv in runner.kv_caches for c in kv]

    prior = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (fused_logits, fused_kv), (loop_logits, loop_kv) = forward(True), forward(False)
    finally:
        torch.set_num_threads(prior)
    assert torch.equal(fused_logits, loop_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, loop_kv))
    assert not all(torch.equal(a, b) for a, b in zip(fused_kv, (c for kv in before for c in kv)))  # K/V written


def test_taken_only_for_decode_steps_the_glue_and_the_kernel_take(q4_gguf: Path) -> None:
    runner = _fused_runner(q4_gguf)
    model = runner.model
    fused, glue = model.fused_decode, model.layer_glue

    def plan(q_lens: list[int], ctx: list[int]) -> object:
        return runner.attn.plan(synthetic_step(q_lens, ctx, runner.block_size, runner.device).attn)

    assert fused.takes(plan([1, 1], [9, 30]), 2, glue, model.linear)
    assert not fused.takes(plan([1, 5], [9, 30]), 6, glue, model.linear)  # a prompt chunk beside the decode
    assert not fused.takes(plan([1, 1], [9, 30]), 2, None, model.linear)  # the glue does not take the rows
    fused.dense_copies = False
    model.linear.plan = Int4Plan(1, torch.bfloat16, "test")  # 2 rows on dense weights: the model keeps no copies
    assert not fused.takes(plan([1, 1], [9, 30]), 2, glue, model.linear)
    fused.dense_copies = True
    assert fused.takes(plan([1, 1], [9, 30]), 2, glue, model.linear)
    runner.attn.decode_kernel._fn = None  # decodes by PyTorch's attention (its gathered groups)
    assert not fused.takes(plan([1, 1], [9, 30]), 2, glue, model.linear)


def test_served_greedy_tokens_are_those_of_the_python_loop(q4_gguf: Path) -> None:
    runner = _fused_runner(q4_gguf)
    jobs = [Job("a", [1, 17, 25, 9, 33, 101, 64, 7, 20, 3, 45, 88], 12), Job("b", [5, 6, 7], 12, arrive_step=2),
            Job("c", list(range(30, 70)), 10, arrive_step=4)]
    calls = []
    real_call = FusedDecode.__call__

    def counted(self: FusedDecode, *args: object) -> None:
        calls.append(args[0].shape[0])
        real_call(self, *args)

    with patch.object(FusedDecode, "__call__", counted):
        fused = run_jobs(runner, jobs, num_blocks=96, budget=16)
    assert calls and max(calls) == 3, calls  # decode steps of one to three rows went through it
    fused_decode, runner.model.fused_decode = runner.model.fused_decode, None
    try:
        loop = run_jobs(runner, jobs, num_blocks=96, budget=16)
    finally:
        runner.model.fused_decode = fused_decode
    assert fused.outputs == loop.outputs
    assert all(len(loop.outputs[j.req_id]) == j.max_tokens for j in jobs)


def test_a_slot_outside_the_cache_raises_and_writes_nothing(q4_gguf: Path) -> None:
    runner = _fused_runner(q4_gguf)
    model = runner.model
    step = synthetic_step([1, 1], [20, 9], runner.block_size, runner.device)
    blocks = runner.kv_caches[0][0].shape[0]
    step.attn.slot_mapping[1] = blocks * runner.block_size  # one past the last slot
    before = [c.clone() for kv in runner.kv_caches for c in kv]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the cache"):
        model(torch.tensor([3, 4]), step.positions, runner.kv_caches, runner.attn, runner.attn.plan(step.attn),
              step.logits_indices)
    assert all(torch.equal(a, b) for a, b in zip(before, (c for kv in runner.kv_caches for c in kv)))


def test_another_copy_of_the_library_is_not_used(q4_gguf: Path) -> None:
    runner = _fused_runner(q4_gguf)
    # Ops registered by a load this module did not make would reach that copy's models, not this one's.
    with patch.object(FusedDecode, "_loaded_here", False), \
            patch("evenflow.worker.models.fused_decode._ops_registered", return_value=True):
        assert FusedDecode.build(runner.model) is None


def test_where_it_is_off_the_log_says_why(q4_gguf: Path, checkpoint_root: Path, tmp_path: Path,
                                         tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=16)  # float32: no narrowing path, no glue
    assert attach_fused_decode(runner.model, runner.attn) == "off (no layer glue)"
    runner = _fused_runner(q4_gguf)
    runner.model.fused_decode = None
    with patch("evenflow.worker.models.fused_decode.load_cpp_sources", return_value=None):
        assert attach_fused_decode(runner.model, runner.attn) == "off (the C++ library did not build)"
    assert runner.model.fused_decode is None
    runner.attn.decode_kernel._fn = None
    assert attach_fused_decode(runner.model, runner.attn) == "off (decode attention is not the C++ kernel)"
    # head_dim 16: a shape the decode kernel does not serve
    small = write_gguf(make_checkpoint(checkpoint_root, seed=12, hidden_size=64, intermediate_size=128),
                       tmp_path / "small-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    runner = make_runner(small, num_blocks=16, quantization="gguf")
    if runner.model.layer_glue is not None:
        assert runner.model.fused_decode is None
        assert attach_fused_decode(runner.model, runner.attn) == "off (decode attention is not the C++ kernel)"
