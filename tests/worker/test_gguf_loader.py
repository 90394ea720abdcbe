"""GGUF files the tests write (gguf.GGUFWriter, from random-weight HF folders) against transformers
loading the same file (``from_pretrained(dir, gguf_file=...)``): greedy tokens equal, F32 and Q8_0,
qwen2 (bias, no permutation) and llama (Q/K rows permuted by the converter, GQA)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from evenflow.worker.config_reader import read_model_config
from evenflow.worker.gguf_weights import dequantize_raw, iter_gguf_raw_tensors, unpermute_rows

from tests.checkpoints import make_checkpoint
from tests.gguf_files import llama_cpp_permute, write_gguf
from tests.worker.harness import Job, make_runner, run_jobs

Q8_0, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


def gguf_reference_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def written(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    qwen2 = make_checkpoint(checkpoint_root, model_type="qwen2", architectures=["Qwen2ForCausalLM"], seed=3)
    llama = make_checkpoint(checkpoint_root, seed=4)
    return {
        "qwen2-f32": write_gguf(qwen2, out / "qwen2-f32.gguf"),
        "qwen2-q8_0": write_gguf(qwen2, out / "qwen2-q8_0.gguf", Q8_0),
        "llama-q8_0": write_gguf(llama, out / "llama-q8_0.gguf", Q8_0),
    }


@pytest.mark.parametrize("name", ["qwen2-f32", "qwen2-q8_0", "llama-q8_0"])
def test_written_gguf_greedy_matches_transformers_on_the_same_file(written: dict[str, Path], name: str) -> None:
    path = written[name]
    runner = make_runner(path, num_blocks=64, block_size=8)
    jobs = [Job(f"{name}-a", [5, 9, 200, 17, 3, 88, 41], 10), Job(f"{name}-b", list(range(30, 53)), 8)]
    result = run_jobs(runner, jobs, num_blocks=64, budget=16)
    assert result.outputs == {j.req_id: gguf_reference_greedy(path, j.prompt, j.max_tokens) for j in jobs}


def test_written_config_reads_like_the_folder(checkpoint_root: Path, written: dict[str, Path]) -> None:
    from_gguf = read_model_config(written["qwen2-f32"])
    from_folder = read_model_config(make_checkpoint(checkpoint_root, model_type="qwen2",
                                                    architectures=["Qwen2ForCausalLM"], seed=3))
    differing = {k for k in from_gguf.__dataclass_fields__ if getattr(from_gguf, k) != getattr(from_folder, k)}
    assert differing <= {"rms_norm_eps"}, differing
    assert from_gguf.rms_norm_eps == pytest.approx(from_folder.rms_norm_eps, rel=1e-6)  # GGUF stores float32


def test_raw_tensors_keep_the_blocks_with_rows_in_hf_order(checkpoint_root: Path, written: dict[str, Path]) -> None:
    """The raw iterator's Q8_0 blocks, dequantized, give the HF folder's q_proj (to Q8_0 precision)."""
    from safetensors.numpy import load_file

    path = written["llama-q8_0"]
    cfg = read_model_config(path)
    raw = {t.name: t for t in iter_gguf_raw_tensors(path, cfg)}
    q = raw["model.layers.1.self_attn.q_proj.weight"]
    assert q.qtype == Q8_0 and q.data.dtype == np.uint8 and q.shape == (64, 64)
    hf = load_file(str(make_checkpoint(checkpoint_root, seed=4) / "model.safetensors"))
    expected = hf["model.layers.1.self_attn.q_proj.weight"]
    got = dequantize_raw(q, torch.float32).numpy()
    assert np.abs(got - expected).max() < np.abs(expected).max() / 100  # Q8_0: 1/127 of a block's range


def test_unpermute_inverts_the_converters_permutation() -> None:
    w = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 2, 3):
        assert np.array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)
