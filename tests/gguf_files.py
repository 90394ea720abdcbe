"""GGUF files for tests, written with ``gguf.GGUFWriter`` from the random-weight HF folders of
tests/checkpoints.py, the way llama.cpp's converter writes them (names, Q/K row permutation for
llama/mistral, metadata keys), plus a byte-level tokenizer of the 256 bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list[str]:
    """The 256 byte-alphabet characters in byte order (a byte-level BPE with no merges)."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    printable = [b for b in range(256) if chr(b) in alphabet]
    spelled, extra = [], 0
    for b in range(256):
        if b in printable:
            spelled.append(chr(b))
        else:
            spelled.append(chr(256 + extra))
            extra += 1
    return spelled


def write_gguf(hf_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               arch_override: str | None = None, metadata: dict[str, Any] | None = None,
               tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write ``hf_dir`` as a GGUF (matrices stored as ``qtype``, vectors as F32). ``tokenizer`` writes
    the ``tokenizer.ggml.*`` keys (default: the 256-byte byte-level BPE); ``extra_tensors`` are
    written as they are (``rope_freqs.weight``, ...)."""
    import json

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch_override or cfg["model_type"]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32
                         else gguf.LlamaFileType.MOSTLY_Q8_0)
    if tokenizer is not None:
        tokenizer(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        tokens = byte_tokens()[: cfg["vocab_size"]]
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        writer.add_token_merges([])
        writer.add_bos_token_id(cfg["bos_token_id"])
        writer.add_eos_token_id(cfg["eos_token_id"])
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, _value_type(value))
    permuted = arch in ("llama", "mistral")
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if permuted and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_key_value_heads"])
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)  # the writer derives the shape from the bytes
        else:
            writer.add_tensor(gguf_name(name), w)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _value_type(value: Any) -> gguf.GGUFValueType:
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32
