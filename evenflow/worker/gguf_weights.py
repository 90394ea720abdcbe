"""GGUF tensors in HuggingFace names and layouts: raw blocks, or dequantized to a torch dtype.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``) and, for llama and mistral,
permutes the rows of Q and K so its rope kernel can rotate adjacent pairs; both are undone here
(transformers' ``modeling_gguf_pytorch_utils`` is the reference). The row permutation moves whole
rows, and quantized blocks never span rows, so it applies to the raw blocks as well: a quantized
kernel can take ``iter_gguf_raw_tensors`` and get HF-layout rows without dequantizing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from evenflow.protocol.gguf_file import GGUFFile, open_gguf
from evenflow.worker.config_reader import ModelConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf part> -> model.layers.N.<hf part>
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel.permute in convert_hf_to_gguf.py).
_PERMUTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class GGUFRawTensor(NamedTuple):
    """One tensor as stored, under its HF name, rows already in HF order."""

    name: str  # HF name, e.g. model.layers.0.self_attn.q_proj.weight
    qtype: GGMLQuantizationType
    data: np.ndarray  # uint8 (rows..., bytes per row): the file's blocks (F32/F16/BF16 values as bytes too)
    shape: tuple[int, ...]  # the dequantized shape, torch order (out_features, in_features)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for one evenflow has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_PARTS:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.{m.group(3)}"


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: within each head, its rows (2 halves interleaved) back to HF's order.

    The converter wrote ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is its inverse. Works on
    values and on raw block rows alike (only the first axis moves).
    """
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _rows_permuted_heads(hf_name: str, cfg: ModelConfig) -> int | None:
    """The head count to un-permute ``hf_name`` with, or None when its rows are in HF order already."""
    if cfg.architecture not in _PERMUTED_ARCHITECTURES:
        return None
    if ".q_proj." in hf_name:
        return cfg.num_heads
    if ".k_proj." in hf_name:
        return cfg.num_kv_heads
    return None


def iter_gguf_raw_tensors(path: str | Path, cfg: ModelConfig, gguf_file: GGUFFile | None = None
                          ) -> Iterator[GGUFRawTensor]:
    """Every tensor evenflow loads, as stored (memory-mapped, copied only where rows are un-permuted)."""
    gguf_file = gguf_file or open_gguf(path)
    for info in gguf_file.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        data = gguf_file.tensor_bytes(info)
        heads = _rows_permuted_heads(name, cfg)
        if heads is not None:
            data = unpermute_rows(data, heads)
        yield GGUFRawTensor(name, info.qtype, data, info.shape)


def dequantize_raw(tensor: GGUFRawTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values in ``dtype`` (vectorised numpy per tensor; BF16 widened exactly)."""
    if tensor.qtype == GGMLQuantizationType.BF16:
        as_int = tensor.data.view(np.uint16).astype(np.uint32) << 16  # bf16 is the top half of a float32
        values = as_int.view(np.float32)
    else:
        values = dequantize(tensor.data, tensor.qtype)
    if not values.flags.writeable:  # F32 dequantizes to a view of the read-only map; torch wants its own
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values).reshape(tensor.shape)).to(dtype)


def iter_gguf_tensors(path: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, values in ``dtype``) for every tensor evenflow loads, one at a time."""
    for tensor in iter_gguf_raw_tensors(path, cfg):
        yield tensor.name, dequantize_raw(tensor, dtype)
