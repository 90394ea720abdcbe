"""Every storage type evenflow loads, written into a GGUF and read back by the loader's path
(``iter_gguf_raw_tensors`` + ``dequantize_raw``): K-quants and Q4_0/Q4_1/Q8_0 against transformers'
own torch dequantizer (an independent implementation) on random blocks; Q5_0/Q5_1/F16/BF16
against the values they were quantized from; the row un-permutation on raw blocks equals the
un-permutation of the values."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from evenflow.protocol.gguf_file import SUPPORTED_TENSOR_TYPES
from evenflow.worker.config_reader import ModelConfig
from evenflow.worker.gguf_weights import dequantize_raw, iter_gguf_raw_tensors, unpermute_rows

Q = gguf.GGMLQuantizationType
ROWS, COLS = 16, 512  # COLS: two K-quant super-blocks of 256
# Byte offsets of each block's float16 scale fields (random bytes there would be NaN/inf).
HALF_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
QUANTIZED_FROM_VALUES = {Q.Q5_0: 0.1, Q.Q5_1: 0.1, Q.F16: 1e-3, Q.BF16: 1e-2}  # relative tolerance


def config(architecture: str = "Qwen2ForCausalLM") -> ModelConfig:
    return ModelConfig(architecture=architecture, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
                       rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                       sliding_window=None, torch_dtype="float32")


def random_blocks(qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS, COLS // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.05, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(ROWS, -1)


def write_one(path: Path, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_back(path: Path, cfg: ModelConfig | None = None) -> torch.Tensor:
    (tensor,) = list(iter_gguf_raw_tensors(path, cfg or config()))
    assert tensor.shape == (ROWS, COLS)
    return dequantize_raw(tensor, torch.float32)


def test_every_supported_type_is_covered() -> None:
    assert {t.name for t in HALF_FIELDS} | {t.name for t in QUANTIZED_FROM_VALUES} | {"F32"} == set(SUPPORTED_TENSOR_TYPES)


@pytest.mark.parametrize("qtype", list(HALF_FIELDS), ids=lambda t: t.name)
def test_blocks_dequantize_as_transformers_does(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    blocks = random_blocks(qtype, np.random.default_rng(int(qtype)))
    got = read_back(write_one(tmp_path / "t.gguf", "blk.0.ffn_up.weight", blocks, qtype))
    expected = hf_dequantize(torch.from_numpy(blocks.copy()), int(qtype)).reshape(ROWS, COLS)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", list(QUANTIZED_FROM_VALUES), ids=lambda t: t.name)
def test_types_read_back_the_values_they_were_written_from(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    values = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    data = gguf.quants.quantize(values, qtype) if qtype != Q.F16 else values.astype(np.float16)
    got = read_back(write_one(tmp_path / "t.gguf", "blk.0.ffn_up.weight", data, qtype)).numpy()
    assert np.abs(got - values).max() <= QUANTIZED_FROM_VALUES[qtype] * np.abs(values).max()


def test_raw_rows_are_unpermuted_for_llama(tmp_path: Path) -> None:
    """A llama Q4_K q_proj: un-permuting raw block rows then dequantizing = dequantizing then un-permuting."""
    blocks = random_blocks(Q.Q4_K, np.random.default_rng(7))
    path = write_one(tmp_path / "q.gguf", "blk.0.attn_q.weight", blocks, Q.Q4_K)
    got = read_back(path, config("LlamaForCausalLM"))
    plain = gguf.quants.dequantize(blocks, Q.Q4_K)
    assert np.array_equal(got.numpy(), unpermute_rows(plain, 4))
    assert not np.array_equal(got.numpy(), plain)
