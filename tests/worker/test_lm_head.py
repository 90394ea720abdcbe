"""The screened LM head (models/lm_head.py) against the float32 head it stands in for: the leading
logits of every row are float32's, the rest within the screen's rounding (bfloat16 or float16); on
argmax-only steps (the 4-bit screen) the argmax is float32's; a real int4 model serves through it,
with the bfloat16 screen only where the CPU has native bfloat16 (else float16 where FBGEMM is), and
through the 4-bit screen only on plain greedy steps of up to the int4 plan's rows."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from evenflow.worker.models import lm_head
from evenflow.worker.models.fp16_gemm import fp16_gemm_works
from evenflow.worker.models.greedy_screen import load_greedy_screen
from evenflow.worker.models.linear import TorchLinear, cpu_has_fast_path
from evenflow.worker.models.int4_gemv import NO_GEMV, GemvRows, load_int4_gemv
from evenflow.worker.models.lm_head import SCREEN_TOP, ScreenedHead
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from evenflow.protocol import SamplingParams
from tests.worker.harness import Job, greedy, make_runner, run_jobs

BF16_FAST = cpu_has_fast_path(torch.bfloat16) and ScreenedHead.works()
needs_bf16 = pytest.mark.skipif(not BF16_FAST, reason="no native bfloat16 on this CPU: no bfloat16 screen")
needs_fp16 = pytest.mark.skipif(not fp16_gemm_works(), reason="this torch has no FBGEMM float16 GEMM")
SCREENS = [pytest.param("bfloat16", marks=needs_bf16), pytest.param("float16", marks=needs_fp16)]
# Every kind of head this CPU can run: the two screens, and the float32 one with a 4-bit screen.
HEAD_KINDS = [*SCREENS, pytest.param("float32")]


def head_of(table: torch.Tensor, kind: str, int4_rows: int = 1 << 30) -> ScreenedHead:
    return ScreenedHead(table, kind, TorchLinear() if kind == "float32" else None, int4_rows)


@pytest.mark.parametrize("kind", SCREENS)
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: more rows than one gather takes
def test_leading_logits_are_float32_and_the_rest_within_the_screens_rounding(rows: int, kind: str) -> None:
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(3000, 96, generator=g) * 0.2
    x = torch.randn(rows, 96, generator=g)
    reference = x.double() @ table.double().t()
    got = head_of(table, kind)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 3000)
    assert torch.equal(got.argmax(1), reference.argmax(1))
    # A row's float32-recomputed logits: its SCREEN_TOP largest by the screen, the reference's top
    # SCREEN_TOP / 2 among them wherever the screen's error is small against their spread (it is here).
    lead = reference.topk(SCREEN_TOP // 2, dim=1).indices
    torch.testing.assert_close(got.gather(1, lead).double(), reference.gather(1, lead), rtol=1e-5, atol=1e-5)
    step = 2.0 ** (-8 if kind == "bfloat16" else -11) * float(reference.abs().max())
    assert float((got.double() - reference).abs().max()) <= 2 * step


def test_without_a_bf16_screen_the_logits_are_float32s() -> None:
    g = torch.Generator().manual_seed(0)
    table, x = torch.randn(3000, 96, generator=g), torch.randn(5, 96, generator=g)
    head = head_of(table, "float32")
    assert head.exact and torch.equal(head(x), torch.nn.functional.linear(x, table))
    assert head.step_nbytes(5) == table.nbytes


def test_int4_model_serves_the_screened_head_and_float32_keeps_the_dense_one(checkpoint_root: Path,
                                                                              tmp_path: Path) -> None:
    model = write_gguf(make_checkpoint(checkpoint_root, seed=3), tmp_path / "q4_1.gguf",
                       gguf.GGMLQuantizationType.Q4_1)
    int4 = make_runner(model, num_blocks=16, block_size=16, max_model_len=64, quantization="gguf").model
    dense = make_runner(model, num_blocks=16, block_size=16, max_model_len=64, quantization="none").model
    assert isinstance(int4._screened_head, ScreenedHead) and int4._head is None
    assert int4._screened_head.kind == ("bfloat16" if BF16_FAST else "float16" if fp16_gemm_works() else "float32")
    assert 0 <= int4._screened_head.int4_rows <= int4.int4_plan.max_int4_rows  # its own crossover, measured
    assert dense._screened_head is None and dense._head is not None


@pytest.mark.parametrize("kind", HEAD_KINDS)
@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("spread", [0.2, 1e-3])  # 1e-3: logits far closer than the 4-bit error, all suspects
@pytest.mark.parametrize("screen_kernel", ["torch int4", "gemv"])
@pytest.mark.parametrize("finish", ["C++", "PyTorch"])
def test_the_greedy_screen_keeps_float32s_argmax_and_its_value(rows: int, spread: float, kind: str,
                                                               screen_kernel: str, finish: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if finish == "PyTorch":
        monkeypatch.setattr(lm_head, "load_greedy_screen", lambda: None)
    elif load_greedy_screen() is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(1, 96, generator=g) * 0.2
    table = base + torch.randn(3000, 96, generator=g) * spread  # 3000: not whole 64-row tiles
    x = torch.randn(rows, 96, generator=g)
    reference = x.double() @ table.double().t()
    head = head_of(table, kind)
    assert head.int4 is not None and head.step_nbytes(rows, greedy=True) == head.int4.weight.nbytes
    if screen_kernel == "gemv" and load_int4_gemv() is None:
        pytest.skip("evenflow's int4 GEMV does not run on this CPU")
    head.int4.gemv_rows = GemvRows(1, rows) if screen_kernel == "gemv" else NO_GEMV  # whatever start-up chose
    got = head(x, greedy=True)
    assert got.dtype == torch.float32 and got.shape == (rows, 3000)
    assert torch.equal(got.argmax(1), reference.argmax(1))
    best = got.gather(1, got.argmax(1, keepdim=True))
    torch.testing.assert_close(best.double(), reference.max(1, keepdim=True).values, rtol=1e-5, atol=1e-5)


class _Recorder:
    """Stands in for the model's screened head, noting each call's ``greedy`` flag."""

    def __init__(self, head: ScreenedHead) -> None:
        self.head, self.flags = head, []

    def __call__(self, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        self.flags.append(greedy)
        return self.head(x, greedy)


def test_only_plain_greedy_steps_take_the_greedy_screen(checkpoint_root: Path, tmp_path: Path) -> None:
    model = write_gguf(make_checkpoint(checkpoint_root, seed=3), tmp_path / "q4_1.gguf",
                       gguf.GGMLQuantizationType.Q4_1)
    runner = make_runner(model, num_blocks=16, block_size=16, max_model_len=64, quantization="gguf")
    recorder = _Recorder(runner.model._screened_head)
    runner.model._screened_head = recorder
    prompt = [1, 5, 9, 3]
    run_jobs(runner, [Job("g", prompt, 4, params=greedy(4))], num_blocks=16)
    assert recorder.flags and all(recorder.flags)
    recorder.flags.clear()
    for params in (SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True),
                   SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)):
        run_jobs(runner, [Job("s", prompt, 4, params=params)], num_blocks=16)
    assert recorder.flags and not any(recorder.flags)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_greedy_steps_above_the_int4_rows_take_the_other_screen(kind: str) -> None:
    g = torch.Generator().manual_seed(4)
    table, x = torch.randn(3000, 96, generator=g) * 0.2, torch.randn(6, 96, generator=g)
    head = head_of(table, kind, int4_rows=4)
    assert head.step_nbytes(4, greedy=True) == head.int4.weight.nbytes
    assert head.step_nbytes(6, greedy=True) == head.step_nbytes(6) > head.int4.weight.nbytes
    assert torch.equal(head(x, greedy=True), head(x))  # 6 rows: the screen every step takes, not the 4-bit one
    assert not torch.equal(head(x[:4], greedy=True), head(x[:4]))  # 4 rows: the 4-bit screen's rough tail


def test_the_4bit_screens_rows_are_the_heads_own_crossover(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4-bit screen's cost grows with the rows (it dequantizes per row), the other screen's hardly:
    the head takes it up to the last probe it won, never above the cap."""
    import evenflow.worker.models.lm_head as lm_head

    table = torch.randn(256, 64)
    head = head_of(table, "float32")
    timed: list[int] = []

    def fake_time_min(fns: list) -> list[float]:
        rows = len(timed) + 1
        timed.append(rows)
        return [float(1 << (rows - 1)), 3.0]  # 4-bit: 1, 2, 4, ... against 3

    monkeypatch.setattr(lm_head, "time_min", fake_time_min)
    assert head.measured_int4_rows(8) == 2 and len(timed) == 3  # stops at the first probe it loses
    timed.clear()
    assert head.measured_int4_rows(1) == 1 and head.measured_int4_rows(0) == 0
    head.int4 = None
    assert head.measured_int4_rows(8) == 0


def test_the_cpp_pass_computes_what_the_pytorch_ops_do() -> None:
    """The C++ recompute against the fallback's ops on a screen of known error, at a width (100) whose dot
    products have a tail past the 16-wide part, with the screen padded past the vocabulary."""
    finish = load_greedy_screen()
    if finish is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")
    g = torch.Generator().manual_seed(3)
    vocab, hidden, rows = 300, 100, 3
    table, x = torch.randn(vocab, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    exact = x @ table.t()
    screen = torch.zeros(rows, 320, dtype=torch.bfloat16)
    screen[:, :vocab] = (exact + torch.randn(rows, vocab, generator=g)).bfloat16()
    row_error = torch.full((1, vocab), 0.05)
    got = finish(screen, x, table, row_error, 10.0)
    logits = screen[:, :vocab].float()
    lead = logits.argmax(1)
    floor = (table[lead] * x).sum(1, keepdim=True)
    reach = logits + 10.0 * x.norm(dim=1, keepdim=True) * row_error
    want = torch.where(reach >= floor, exact, logits)
    want[torch.arange(rows), lead] = floor.squeeze(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(1), exact.argmax(1))
    with pytest.raises(ValueError):
        finish(screen[:2], x, table, row_error, 10.0)  # rows that do not match



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_cpp_pass_takes_the_first_of_tied_leaders_on_any_thread_count(threads: int) -> None:
    """The vocabulary split between threads still finds torch's argmax of the screen, the first of equal maxima
    (here one in the first thread's part and one in the last's), and the same logits on any thread count."""
    finish = load_greedy_screen()
    if finish is None:
        pytest.skip("no C++ compiler for inductor's toolchain here")
    vocab, hidden = 300, 100
    x = torch.zeros(1, hidden)
    x[0, 0] = 1.0
    table = torch.full((vocab, hidden), 0.0)
    table[:, 0] = -10.0
    table[10, 0], table[250, 0] = 6.0, 4.0  # float32's logits: token 10 leads
    screen = torch.full((1, vocab), -10.0).bfloat16()
    screen[0, 10] = screen[0, 250] = 5.0  # the screen ties them: the first, 10, is its leader
    prior = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = finish(screen, x, table, torch.zeros(vocab), 10.0)
    finally:
        torch.set_num_threads(prior)
    # led by 10: its float32 value 6 is the floor, 250's screen value (5) stays below it; led by 250 the floor
    # would be 4 and 250 would read 4
    assert got[0, 10] == 6.0 and got[0, 250] == 5.0
    assert got.argmax(1).item() == 10
