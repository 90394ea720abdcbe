"""A Q4_0/Q4_1 GGUF through the loader (tests write it from a random-weight llama): ``--quantization
gguf`` keeps every projection 4-bit and the LM head dequantized, the logits track the float32
path's on the same file, ``none`` stays the exact dequantized path, unset follows ``--dtype``, and
the flag's misuses are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from evenflow.protocol import WorkerConfig
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan
from evenflow.worker.models.linear import cpu_has_fast_path
from evenflow.worker.models.q4_blocks import Int4Weight
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.real.scoring import score
from tests.worker.harness import make_runner

Q4 = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}
PROMPT = [1, 17, 250, 9, 33, 101, 64, 7, 200, 3, 45, 88, 12, 190, 66, 5]


@pytest.fixture(scope="module")
def written(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-q4")
    llama = make_checkpoint(checkpoint_root, seed=5)
    return {name: write_gguf(llama, out / f"llama-{name}.gguf", qtype) for name, qtype in Q4.items()}


@pytest.mark.parametrize("name", sorted(Q4))
@pytest.mark.parametrize("max_int4_rows", [0, 64])  # the dequantized dense path, then the int4 kernel
def test_q4_gguf_kept_4bit_tracks_the_float32_path(written: dict[str, Path], name: str, max_int4_rows: int) -> None:
    exact = make_runner(written[name], num_blocks=16, quantization="none")
    int4 = make_runner(written[name], num_blocks=16, quantization="gguf")
    assert not exact.model.int4_param_names()
    assert isinstance(int4.model.linear, Int4CpuLinear)
    assert len(int4.model.int4_param_names()) == 4 * int4.model_config.num_layers
    assert not isinstance(int4.model._head, Int4Weight)  # the LM head as the GGUF holds it, dequantized
    # Beside int4 projections the KV cache is bfloat16 where the CPU has it natively or decode steps take the
    # int4 kernel (bfloat16 activations); float32 stays float32.
    kv = (torch.bfloat16 if cpu_has_fast_path(torch.bfloat16) or int4.model.int4_plan.max_int4_rows > 0
          else torch.float32)
    assert int4.kv_dtype == kv and int4.kv_caches[0][0].dtype == kv and int4.attn.kv_dtype == kv
    assert exact.kv_dtype == torch.float32 and exact.kv_caches[0][0].dtype == torch.float32
    int4.model.linear.plan = Int4Plan(max_int4_rows, torch.float32, "test")
    reference, got = score(exact, PROMPT, len(PROMPT)), score(int4, PROMPT, len(PROMPT))
    diff = (got.logits - reference.logits).abs()
    scale = float(reference.logits.abs().max())
    assert float(diff.max()) <= 0.05 * scale and float(diff.mean()) <= 0.01 * scale, (diff.max(), diff.mean(), scale)
    assert abs(got.perplexity / reference.perplexity - 1) <= 0.02


def test_quantization_flag_misuse_is_refused(written: dict[str, Path], tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="is not a .gguf file"):
        make_runner(tiny_llama, num_blocks=16, quantization="gguf")
    with pytest.raises(ValueError, match="unknown quantization 'awq'"):
        make_runner(written["q4_1"], num_blocks=16, quantization="awq")


def test_unset_quantization_follows_the_dtype(written: dict[str, Path]) -> None:
    """An explicit --dtype asks for weights in that dtype (the float32 reference path stays exact);
    --dtype auto keeps the 4-bit projections wherever the start-up plan found the int4 kernel faster."""
    explicit = make_runner(written["q4_1"], num_blocks=16)  # the harness passes --dtype float32
    assert not explicit.model.int4_param_names()
    auto = ModelRunner(WorkerConfig(model=str(written["q4_1"]), dtype="auto", device="cpu", block_size=8,
                                    max_model_len=64, num_kv_blocks=16))
    plan = auto.model.int4_plan  # the plan it measured
    assert plan is not None and bool(auto.model.int4_param_names()) == (plan.max_int4_rows > 0)


def test_a_cpu_whose_int4_layout_is_unknown_dequantizes_or_refuses(written: dict[str, Path]) -> None:
    """ATen's scalar int4 packing (a CPU with neither AVX2 nor AVX-512) is a layout evenflow does not
    read: --dtype auto dequantizes the weights, --quantization gguf is refused at load, neither misreads."""
    script = f"""
import sys
from evenflow.protocol import WorkerConfig
from evenflow.worker.runner import ModelRunner
cfg = dict(model={str(written["q4_1"])!r}, dtype="auto", device="cpu", block_size=8, max_model_len=64, num_kv_blocks=16)
print("auto int4 params:", len(ModelRunner(WorkerConfig(**cfg)).model.int4_param_names()))
try:
    ModelRunner(WorkerConfig(**cfg, quantization="gguf"))
except ValueError as exc:
    print("refused:", exc)
"""
    env = {"ATEN_CPU_CAPABILITY": "default", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert "auto int4 params: 0" in out
    assert "refused: --quantization gguf keeps 4-bit weights, which this machine cannot" in out
