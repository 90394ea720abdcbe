"""A GGUF file's metadata in ``config.json``'s terms, so every reader of HF configs reads GGUF too.

llama.cpp's keys (``{arch}.embedding_length``, ``{arch}.attention.head_count_kv``, ...) become
the HF keys the engine-core and the worker already read (``hidden_size``,
``num_key_value_heads``, ...); see ``evenflow.protocol.hf_config.read_hf_config``, the one entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evenflow.protocol.gguf_file import GGUFFile, GGUFFileError, check_tensor_types, open_gguf

# general.architecture -> the HF class the worker builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# {arch}.<key> -> config.json key (transformers' GGUF_CONFIG_MAPPING, for the keys evenflow reads).
_ARCH_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_HALF_TYPES = {"F16": "float16", "BF16": "bfloat16"}


def gguf_to_hf_config(path: str | Path) -> tuple[dict[str, Any], list[int]]:
    """(config.json-style dict, EOS ids) from a GGUF file; GGUFFileError naming the file otherwise."""
    path = Path(path).expanduser().resolve()
    gguf_file = open_gguf(path)
    arch = gguf_file.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFFileError(f"{path}: unsupported GGUF architecture {arch!r} (supported: "
                            f"{', '.join(GGUF_ARCHITECTURES)})")
    check_tensor_types(gguf_file)
    config: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch}
    for key, hf_key in _ARCH_KEYS.items():
        value = gguf_file.get(f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise GGUFFileError(f"{path}: metadata has no {arch}.* key for {', '.join(missing)}")
    _check_rope(gguf_file, arch)
    rotary = gguf_file.get(f"{arch}.rope.dimension_count")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rotary is not None and int(rotary) != head_dim:
        raise GGUFFileError(f"{path}: partial rotary embedding ({rotary} of {head_dim} dims) is not supported")
    tensor_names = {t.name for t in gguf_file.tensors}
    config.setdefault("vocab_size", len(gguf_file.get("tokenizer.ggml.tokens", ())) or _embedding_rows(gguf_file))
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    config["torch_dtype"] = _file_dtype(gguf_file)
    bos = gguf_file.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    # llama.cpp stops at EOS and at EOT (end of turn) where a file names one.
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = gguf_file.get(key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    if eos:
        config["eos_token_id"] = eos[0]
    return config, eos


def _check_rope(gguf_file: GGUFFile, arch: str) -> None:
    """Only plain rope is read from GGUF metadata; scaled rope (linear, yarn, llama3's rope_freqs) is refused."""
    scaling = gguf_file.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFFileError(f"{gguf_file.path}: rope scaling {scaling!r} is not supported from GGUF metadata")
    if any(t.name == "rope_freqs.weight" for t in gguf_file.tensors):
        raise GGUFFileError(f"{gguf_file.path}: per-frequency rope factors (rope_freqs.weight, llama3 scaling) are not "
                            f"supported from GGUF; serve the HF folder instead")


def _embedding_rows(gguf_file: GGUFFile) -> int:
    for t in gguf_file.tensors:
        if t.name == "token_embd.weight":
            return t.shape[0]
    raise GGUFFileError(f"{gguf_file.path}: no tokenizer.ggml.tokens and no token_embd.weight: vocabulary size unknown")


def _file_dtype(gguf_file: GGUFFile) -> str:
    """The float type the weights were written in: half where every matrix is half, else float32
    (quantized blocks dequantize to float32 unless --dtype asks otherwise)."""
    types = {t.qtype.name for t in gguf_file.tensors if len(t.shape) >= 2}
    return _HALF_TYPES[next(iter(types))] if len(types) == 1 and types <= set(_HALF_TYPES) else "float32"
