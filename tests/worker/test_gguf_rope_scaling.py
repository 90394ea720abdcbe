"""Rope scaling read from GGUF metadata, against transformers built from the equivalent HF config.

Each random-weight llama checkpoint carries a ``rope_scaling``; the GGUF written from it says the
same in llama.cpp's terms, as its converter writes them: ``llama.rope.scaling.type`` linear (factor)
or yarn (factor, original_context_length, attn_factor), or llama3's per-frequency factors as the
``rope_freqs.weight`` tensor. transformers' own GGUF loader reads none of these for llama (it builds
plain rope from such a file), so the reference is transformers on the HF folder. The scaled
reference differs from the unscaled one, so equality shows the scaling applied, not skipped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from evenflow.core.model_info import read_model_info
from evenflow.protocol.hf_config import read_hf_config

from tests.checkpoints import make_checkpoint, reference_greedy
from tests.gguf_files import write_gguf
from tests.worker.harness import Job, make_runner, run_jobs

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


def llama3_rope_freqs(head_dim: int, theta: float, p: dict[str, Any]) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter computes (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


# name -> (HF rope_scaling, GGUF metadata, GGUF extra tensors)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]] = {
    "linear": (dict(rope_type="linear", factor=4.0),
               {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {}),
    "yarn": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
             {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 64}, {}),
    "yarn-attn-factor": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                              attention_factor=0.8 * (0.1 * math.log(4.0) + 1.0)),
                         {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                          "llama.rope.scaling.original_context_length": 64, "llama.rope.scaling.attn_factor": 0.8}, {}),
    "llama3-rope-freqs": (LLAMA3, {}, {"rope_freqs.weight": llama3_rope_freqs(16, 10000.0, LLAMA3)}),
}
PROMPTS = [[5, 9, 200, 17, 3, 88, 41] * 4, list(range(30, 71))]


@pytest.fixture(scope="module")
def plain(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, seed=11)


@pytest.mark.parametrize("name", sorted(CASES))
def test_scaled_rope_from_gguf_matches_transformers(checkpoint_root: Path, plain: Path, tmp_path: Path,
                                                    name: str) -> None:
    scaling, metadata, extra = CASES[name]
    folder = make_checkpoint(checkpoint_root, seed=11, rope_scaling=dict(scaling))  # transformers edits the dict
    path = write_gguf(folder, tmp_path / f"{name}.gguf", metadata=metadata, extra_tensors=extra)
    runner = make_runner(path, num_blocks=64, block_size=8, max_model_len=256)
    jobs = [Job(f"{name}-{i}", p, 12) for i, p in enumerate(PROMPTS)]
    result = run_jobs(runner, jobs, num_blocks=64, budget=16, max_model_len=256)
    expected = {j.req_id: reference_greedy(folder, j.prompt, j.max_tokens) for j in jobs}
    assert result.outputs == expected
    assert any(expected[j.req_id] != reference_greedy(plain, j.prompt, j.max_tokens) for j in jobs)


def test_gguf_rope_keys_become_the_hf_rope_scaling(checkpoint_root: Path, tmp_path: Path) -> None:
    folder = make_checkpoint(checkpoint_root, seed=11)
    for name, (scaling, metadata, extra) in CASES.items():
        raw = read_hf_config(write_gguf(folder, tmp_path / f"{name}.gguf", metadata=metadata,
                                        extra_tensors=extra)).raw
        if extra:
            assert raw["rope_freq_factors"] == pytest.approx(extra["rope_freqs.weight"].tolist())
        else:
            numbers = {k: v for k, v in scaling.items() if k != "rope_type"}
            assert raw["rope_scaling"]["rope_type"] == scaling["rope_type"]
            assert {k: v for k, v in raw["rope_scaling"].items() if k != "rope_type"} == pytest.approx(numbers)
    # The context length follows vLLM's rule: linear and yarn extend it, llama3's is extended already.
    lengths = {name: read_model_info(tmp_path / f"{name}.gguf").max_model_len for name in CASES}
    assert lengths == {"linear": 2048, "yarn": 256, "yarn-attn-factor": 256, "llama3-rope-freqs": 512}


@pytest.mark.parametrize("metadata, reason", [
    ({"llama.rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor 0.5 is not supported"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0, "llama.rope.scaling.attn_factor": 0.5},
     "attn_factor 0.5 with 'linear' scaling"),
])
def test_unsupported_rope_metadata_is_one_line(checkpoint_root: Path, tmp_path: Path, metadata: dict[str, Any],
                                               reason: str) -> None:
    from evenflow.protocol.gguf_file import GGUFFileError

    path = write_gguf(make_checkpoint(checkpoint_root, seed=11), tmp_path / "bad.gguf", metadata=metadata)
    with pytest.raises(GGUFFileError) as info:
        read_hf_config(path)
    assert reason in str(info.value) and str(info.value).startswith(str(path.resolve()))
