"""Accuracy gate of the int4 path on the real model (SmolLM2-135M-Instruct, Q4_1 GGUF): the same GGUF
served with ``--quantization gguf`` (4-bit projections, bfloat16 activations in the kernel) against
``--quantization none`` (every tensor dequantized to float32, the exact reference path).

Stated tolerances (measured 2026-12-01: decode path ppl ratio 0.9994, mean |dlogit| 0.064, max 0.73;
prefill path 1.0069, 0.134, 0.85; the float16 copy's, 2026-12-03: 0.9981, 0.036, 0.25; the prefill path with
compiled elementwise groups over 324 tokens, 2026-12-05: 1.0014, 0.132, 1.05, eager 1.0025, 0.141, 0.92;
evenflow's GEMV on AVX2, x rounded to 8 bits per 16 columns, 2026-12-07: 0.9926, 0.127, 0.79;
logits span about +-35):
- perplexity of a fixed text within 1% of the float32 path's, through torch's int4 kernel and evenflow's
  GEMV (4 rows a step) and through the dense paths (the whole text in one step);
- logits: mean |difference| <= 0.25, max <= 2.0;
- greedy: on reference prompts, the float32 path's greedy continuation teacher-forced through the int4 path
  picks the same token wherever the float32 path's top two logits are 0.5 or more apart.
"""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from torch._dynamo.utils import counters

from evenflow.frontend.tokenizer import Tokenizer
from evenflow.worker.models.compiled_ops import COMPILE_MIN_ROWS, compile_layer_ops
from evenflow.worker.models.fp16_gemm import fp16_gemm_works
from evenflow.worker.models.int4_gemv import GemvRows, load_int4_gemv
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan
from evenflow.worker.runner import ModelRunner
from tests.worker.harness import Job, greedy, make_runner, run_jobs
from tests.real.scoring import Scored, score

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
        "from Mainz, combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
        "wine. Before his invention, books were copied by hand, a slow and costly process that kept them rare. Within "
        "fifty years, presses were running in more than two hundred cities across Europe, and millions of books had "
        "been printed. Cheaper books spread literacy, helped scientists share their results, and changed how news "
        "and ideas travelled.")
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
PPL_REL_TOL, MEAN_LOGIT_TOL, MAX_LOGIT_TOL, CLEAR_MARGIN = 0.01, 0.25, 2.0, 0.5
DECODE_ROWS = 4  # rows a step through the int4 kernel: decode-sized, and 4x fewer forwards than 1 a step
# Two loads of the real model and ~100 forwards: minutes on a shared 2-core machine.
pytestmark = pytest.mark.timeout(900)


def _runner(gguf: Path, quantization: str) -> ModelRunner:
    return make_runner(gguf, num_blocks=64, block_size=16, max_model_len=512, quantization=quantization)


@pytest.fixture(scope="module")
def float32_runner(smollm2_gguf: Path) -> ModelRunner:
    return _runner(smollm2_gguf, "none")


@pytest.fixture(scope="module")
def int4_runner(smollm2_gguf: Path) -> ModelRunner:
    runner = _runner(smollm2_gguf, "gguf")
    assert isinstance(runner.model.linear, Int4CpuLinear)
    assert len(runner.model.int4_param_names()) == 4 * runner.model_config.num_layers
    return runner


@pytest.fixture(scope="module")
def fp16_copy_runner(smollm2_gguf: Path) -> ModelRunner:
    """The GGUF loaded as a plan that keeps a float16 copy does (where FBGEMM's kernel exists), whatever
    this machine's start-up measurement chose."""
    if not fp16_gemm_works():
        pytest.skip("this torch has no FBGEMM float16 GEMM")
    with patch("evenflow.worker.models.llama.int4_plan", lambda *_: Int4Plan(1, torch.float16, "test", True)):
        return _runner(smollm2_gguf, "gguf")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def text_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def text_reference(float32_runner: ModelRunner, text_ids: list[int]) -> Scored:
    return score(float32_runner, text_ids, len(text_ids))


def _paths_runner(path: str, request: pytest.FixtureRequest) -> ModelRunner:
    return request.getfixturevalue("fp16_copy_runner" if path == "float16 copy" else "int4_runner")


def _dense_plan(path: str) -> Int4Plan:
    """Every row through the many-row path ``path`` names."""
    if path == "float16 copy":
        return Int4Plan(0, torch.float16, "test", dense_copy=True)
    return Int4Plan(0, torch.bfloat16 if "bfloat16" in path else torch.float32, "test")


PATHS = ["int4 kernel", "evenflow's GEMV", "dequantized bfloat16", "dequantized float32", "float16 copy"]


@pytest.mark.parametrize("path", PATHS)
def test_int4_logits_and_perplexity_track_the_float32_path(path: str, text_reference: Scored,
                                                            request: pytest.FixtureRequest,
                                                            text_ids: list[int]) -> None:
    ids, reference = text_ids, text_reference
    int4_runner = _paths_runner(path, request)
    kernel = int4_runner.model.linear
    saved = kernel.plan
    try:  # the path under test, whatever this machine's start-up measurement chose
        if path == "int4 kernel":
            kernel.plan, chunk = Int4Plan(DECODE_ROWS, saved.dense_dtype, "test"), DECODE_ROWS
        elif path == "evenflow's GEMV":
            if load_int4_gemv() is None:
                pytest.skip("evenflow's int4 GEMV does not run here")
            gemv = GemvRows(1, DECODE_ROWS)
            kernel.plan, chunk = Int4Plan(DECODE_ROWS, saved.dense_dtype, "test", gemv_rows=gemv), DECODE_ROWS
        else:
            kernel.plan, chunk = _dense_plan(path), len(ids)
        got = score(int4_runner, ids, chunk)
    finally:
        kernel.plan = saved
    diff = (got.logits - reference.logits).abs()
    assert abs(got.perplexity / reference.perplexity - 1) <= PPL_REL_TOL, (got.perplexity, reference.perplexity)
    assert float(diff.mean()) <= MEAN_LOGIT_TOL and float(diff.max()) <= MAX_LOGIT_TOL, (diff.mean(), diff.max())
    assert float((got.logits.argmax(-1) == reference.logits.argmax(-1)).float().mean()) >= 0.9


def test_fused_layer_ops_track_the_float32_path_as_the_eager_ops_do(float32_runner: ModelRunner,
                                                                      int4_runner: ModelRunner,
                                                                      tokenizer: Tokenizer) -> None:
    """A text long enough for the compiled elementwise groups (models/compiled_ops.py) in one step through
    the dequantized bfloat16 path, with them, with the C++ groups that take such a step where nothing is
    compiled (``--enforce-eager``; models/layer_glue.py, where this CPU runs them), and with neither: all
    within the stated tolerances."""
    ids = tokenizer.encode(" ".join([TEXT] * 3))
    assert len(ids) >= COMPILE_MIN_ROWS
    model = int4_runner.model
    saved_plan, saved_ops, saved_glue = model.linear.plan, model.compiled_ops, model.layer_glue
    try:  # the bfloat16 many-row path, whatever this machine's start-up measurement chose
        model.linear.plan = _dense_plan("dequantized bfloat16")
        assert compile_layer_ops(model, COMPILE_MIN_ROWS, bf16_native=True).startswith("compiled")
        compiled = score(int4_runner, ids, len(ids))
        model.compiled_ops = None
        glue = [score(int4_runner, ids, len(ids))] if saved_glue is not None else []
        model.layer_glue = None
        eager = score(int4_runner, ids, len(ids))
    finally:
        model.linear.plan, model.compiled_ops, model.layer_glue = saved_plan, saved_ops, saved_glue
    reference = score(float32_runner, ids, len(ids))
    for got in (compiled, *glue, eager):
        diff = (got.logits - reference.logits).abs()
        assert abs(got.perplexity / reference.perplexity - 1) <= PPL_REL_TOL, (got.perplexity, reference.perplexity)
        assert float(diff.mean()) <= MEAN_LOGIT_TOL and float(diff.max()) <= MAX_LOGIT_TOL, (diff.mean(), diff.max())


def test_no_step_compiles_after_start_up(int4_runner: ModelRunner, tokenizer: Tokenizer) -> None:
    """The start-up compile covers the steps: a long one later compiles nothing (a guard that failed
    on the model's own tensors would compile for seconds while requests wait)."""
    model = int4_runner.model
    saved_plan, saved_ops = model.linear.plan, model.compiled_ops
    try:
        if saved_ops is None:  # a CPU whose many-row steps stay float32: the bfloat16 path, compiled as start-up does
            model.linear.plan = _dense_plan("dequantized bfloat16")
            assert compile_layer_ops(model, COMPILE_MIN_ROWS, bf16_native=True).startswith("compiled")
        ids = tokenizer.encode(" ".join([TEXT] * 3))
        before = sum(counters["frames"].values())
        score(int4_runner, ids, len(ids))
        assert sum(counters["frames"].values()) == before
    finally:
        model.linear.plan, model.compiled_ops = saved_plan, saved_ops


def test_int4_greedy_agrees_wherever_the_float32_choice_is_clear(float32_runner: ModelRunner,
                                                                 int4_runner: ModelRunner,
                                                                 tokenizer: Tokenizer) -> None:
    max_tokens = 12
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        continuation = run_jobs(float32_runner, [Job("a", ids, max_tokens, params=greedy(max_tokens))],
                                num_blocks=64).outputs["a"]
        full = ids + continuation
        ref = score(float32_runner, full, len(full)).logits[len(ids) - 1:]
        kernel = int4_runner.model.linear
        saved, kernel.plan = kernel.plan, Int4Plan(DECODE_ROWS, kernel.plan.dense_dtype, "test")
        try:
            # the decode kernel, and the argmax-only LM head a plain greedy step takes
            got = score(int4_runner, full, DECODE_ROWS, greedy=True).logits[len(ids) - 1:]
        finally:
            kernel.plan = saved
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= CLEAR_MARGIN
        assert bool(clear.any())
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), prompt


DEMO_CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
             "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("path", PATHS)
def test_the_demo_answer_starts_as_float32_does_through_every_int4_path(
        path: str, float32_runner: ModelRunner, request: pytest.FixtureRequest, tokenizer: Tokenizer) -> None:
    """The README's first question: its top two first tokens ("The", "L") are 0.08 apart in float32, so
    logits rounded anywhere to bfloat16 (a bf16 LM head rounds to 0.125 there) flip the answer."""
    ids = tokenizer.encode(DEMO_CHAT) + [0]  # one more position, so the prompt's last logits are scored
    expected = int(score(float32_runner, ids, len(ids)).logits[-1].argmax())
    assert tokenizer.decode([expected]) == "The"
    int4_runner = _paths_runner(path, request)
    kernel = int4_runner.model.linear
    saved = kernel.plan
    try:
        if path == "int4 kernel":
            kernel.plan = Int4Plan(len(ids), saved.dense_dtype, "test")
        else:
            kernel.plan = _dense_plan(path)
        got = int(score(int4_runner, ids, len(ids)).logits[-1].argmax())
        argmax_only = int(score(int4_runner, ids, len(ids), greedy=True).logits[-1].argmax())
    finally:
        kernel.plan = saved
    assert got == expected, tokenizer.decode([got])
    assert argmax_only == expected, tokenizer.decode([argmax_only])
