"""The CUDA path's decisions, checked on the CPU: backend fallback, GPU count, KV sizing,
forward timing, pinned staging and the warm-up's coverage. (scripts/gpu_check.sh runs the rest
on a GPU.)"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import evenflow.worker.attention.selector as selector
from evenflow.worker.attention.torch_paged import TorchPagedAttention
from evenflow.worker.device_timer import ForwardTimer
from evenflow.worker.kv_cache import CudaMemory, cuda_num_blocks
from evenflow.worker.runner import resolve_device
from evenflow.worker.staging import HostStaging

from .harness import make_runner

CUDA = torch.device("cuda", 0)
GIB = 2**30


def _pretend_flash_attn(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType | None) -> None:
    """flash_attn as installed (found) and, when ``module`` is None, failing to import."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flash_attn", module)  # None: `import flash_attn` raises ImportError
    monkeypatch.delitem(sys.modules, "evenflow.worker.attention.flash", raising=False)


def _fake_flash(version: str) -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.__version__ = version  # type: ignore[attr-defined]
    module.flash_attn_varlen_func = lambda *a, **k: None  # type: ignore[attr-defined]
    return module


def _fallback() -> type:
    if importlib.util.find_spec("triton") is None:
        return TorchPagedAttention
    from evenflow.worker.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention


def test_flash_attn_that_fails_to_import_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    _pretend_flash_attn(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="evenflow.worker.attention"):
        assert selector.select_backend("auto", CUDA, torch.bfloat16) is _fallback()
    assert "not using flash-attn" in caplog.text and "does not import" in caplog.text
    with pytest.raises(ValueError, match="does not import"):
        selector.select_backend("flash_attn", CUDA, torch.bfloat16)


def test_flash_attn_older_than_2_5_7_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_flash_attn(monkeypatch, _fake_flash("2.5.6"))
    assert selector.flash_attn_problem() == "flash-attn 2.5.6 is older than 2.5.7 (the first with a paged KV cache)"
    assert selector.select_backend("auto", CUDA, torch.float16) is _fallback()
    with pytest.raises(ValueError, match="older than 2.5.7"):
        selector.select_backend("flash_attn", CUDA, torch.float16)


def test_flash_attn_that_imports_and_is_recent_is_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_flash_attn(monkeypatch, _fake_flash("2.7.4.post1"))
    backend = selector.select_backend("auto", CUDA, torch.bfloat16)
    assert backend.name == "flash_attn"
    assert selector.select_backend("auto", CUDA, torch.float32) is _fallback()  # flash-attn is half precision only
    monkeypatch.delitem(sys.modules, "evenflow.worker.attention.flash", raising=False)  # bound to the fake


def test_tensor_parallel_larger_than_the_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert resolve_device("auto", 0, 1) == CUDA
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 needs 2 GPUs, one per rank, but 1 is visible "
                                         r"\(CUDA_VISIBLE_DEVICES=3\)"):
        resolve_device("auto", 1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", 1, 2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="pins all 2 tensor-parallel ranks to one GPU"):
        resolve_device("cuda:0", 1, 2)
    assert resolve_device("cpu", 1, 2) == torch.device("cpu")


def test_cuda_kv_sizing_honours_kv_cache_memory_and_counts_activations() -> None:
    mem = CudaMemory(total=80 * GIB, used=20 * GIB, activation_peak=4 * GIB)
    block = 2 * 2**20
    assert cuda_num_blocks(block, mem, None) == (72 * GIB - 24 * GIB) // block  # 90% of the device
    assert cuda_num_blocks(block, mem, 10 * GIB) == 10 * GIB // block  # as asked, not the 90% share
    assert cuda_num_blocks(block, mem, 56 * GIB) == 56 * GIB // block  # above 90% but it fits: allowed
    with pytest.raises(ValueError, match="does not fit on the device: 56.00 GiB are left"):
        cuda_num_blocks(block, mem, 57 * GIB)
    assert cuda_num_blocks(block, CudaMemory(80 * GIB, 75 * GIB, 4 * GIB), None) == 0


class _FakeEvent:
    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, end: "_FakeEvent") -> float:
        self.log.append("elapsed")
        return 12.5  # milliseconds


def test_forward_time_on_cuda_is_read_from_events_after_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    timer = ForwardTimer(CUDA)
    timer.start()
    timer.stop()
    assert timer.seconds() == 0.0125
    assert _FakeEvent.log == ["record", "record", "synchronize", "elapsed"]
    cpu = ForwardTimer(torch.device("cpu"))
    cpu.start()
    cpu.stop()
    assert 0 <= cpu.seconds() < 1


def test_staging_reuses_its_buffers_and_grows_them() -> None:
    staging = HostStaging(torch.device("meta"))  # a non-CPU device without CUDA: exercises the copy path
    staging.begin()
    out = staging.to_device("ids", np.arange(10, dtype=np.int64))
    assert out.device.type == "meta" and out.shape == (10,)
    buffer = staging._buffers["ids"]
    assert buffer[:10].tolist() == list(range(10))
    staging.to_device("ids", np.arange(5, dtype=np.int64) + 100)
    assert staging._buffers["ids"] is buffer and buffer[:5].tolist() == [100, 101, 102, 103, 104]
    table = staging.to_device("table", np.ones((3, 4), dtype=np.int32))
    assert table.shape == (3, 4) and table.dtype == torch.int32
    staging.to_device("ids", np.zeros(5000, dtype=np.int64))
    assert staging._buffers["ids"] is not buffer and staging._buffers["ids"].numel() >= 5000
    staging.end()
    cpu = HostStaging(torch.device("cpu"))
    array = np.arange(4, dtype=np.int64)
    assert cpu.to_device("x", array).data_ptr() == array.ctypes.data  # no copy on the CPU


def test_warm_up_reaches_both_query_tiles_and_profiling_runs_the_sampler(tiny_llama: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(tiny_llama, num_blocks=64, max_num_batched_tokens=256, max_num_seqs=8)
    planned: list[int] = []
    real_plan = runner.attn.plan
    monkeypatch.setattr(runner.attn, "plan", lambda inputs: planned.append(inputs.max_query_len) or real_plan(inputs))
    sampled: list[int] = []
    real_sampler = runner.sampler
    monkeypatch.setattr(runner, "sampler", lambda logits, meta: sampled.append(meta.num_reqs) or real_sampler(logits, meta))
    runner.warm_up()
    assert min(planned) <= 16 < max(planned)  # Triton's 16-row and 64-row query tiles
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # the borrowed blocks are zero again
    planned.clear()
    sampled.clear()
    runner.profile_forward()
    assert planned == [256] and sampled == [8]  # the largest step, then max_num_seqs samples
