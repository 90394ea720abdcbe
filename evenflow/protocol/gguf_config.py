"""A GGUF file's metadata in ``config.json``'s terms, so every reader of HF configs reads GGUF too.

llama.cpp's keys (``{arch}.embedding_length``, ``{arch}.attention.head_count_kv``, ...) become
the HF keys the engine-core and the worker already read (``hidden_size``,
``num_key_value_heads``, ...); see ``evenflow.protocol.hf_config.read_hf_config``, the one entry.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
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
    config.update(_rope_config(gguf_file, arch, config.get("max_position_embeddings")))
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


def _rope_config(gguf_file: GGUFFile, arch: str, context_length: int | None) -> dict[str, Any]:
    """The config.json rope keys of llama.cpp's ``{arch}.rope.scaling.*`` metadata and ``rope_freqs.weight``.

    linear and yarn become transformers' ``rope_scaling`` (the inverse of llama.cpp's converter);
    llama3's per-frequency divisors, which the converter writes as the ``rope_freqs.weight`` tensor
    instead of the HF parameters, become ``rope_freq_factors`` (evenflow's key: HF has none).
    """
    def key(name: str) -> Any:
        return gguf_file.get(f"{arch}.rope.scaling.{name}")

    # llama.cpp reads a missing type as linear, and the factor from the older key where the new one is absent.
    kind = key("type")
    factor = key("factor") or gguf_file.get(f"{arch}.rope.scale_linear")
    if kind is None and factor not in (None, 0, 1):
        kind = "linear"
    attn_factor = key("attn_factor")
    freqs = next((t for t in gguf_file.tensors if t.name == "rope_freqs.weight"), None)
    if kind not in (None, "none") and freqs is not None:
        raise GGUFFileError(f"{gguf_file.path}: rope_freqs.weight together with rope scaling {kind!r} is not supported")
    if freqs is not None:
        if freqs.qtype.name not in ("F32", "F16"):
            raise GGUFFileError(f"{gguf_file.path}: rope_freqs.weight is stored as {freqs.qtype.name} (F32 or F16 read)")
        values = gguf_file.tensor_bytes(freqs).view(np.float32 if freqs.qtype.name == "F32" else np.float16)
        return {"rope_freq_factors": [float(v) for v in values.reshape(-1)]}
    if kind in (None, "none"):
        return {}
    if attn_factor not in (None, 1.0) and kind != "yarn":
        raise GGUFFileError(f"{gguf_file.path}: rope.scaling.attn_factor {attn_factor} with {kind!r} scaling is not "
                            f"supported")
    if kind == "linear":
        return {} if factor in (None, 0, 1) else {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind != "yarn":
        raise GGUFFileError(f"{gguf_file.path}: rope scaling {kind!r} is not supported (supported: linear, yarn, "
                            f"llama3's rope_freqs)")
    ext_factor = key("yarn_ext_factor")
    if ext_factor not in (None, 1.0):
        raise GGUFFileError(f"{gguf_file.path}: yarn_ext_factor {ext_factor} is not supported (only 1, transformers')")
    original = key("original_context_length") or context_length
    if not factor or not original:
        raise GGUFFileError(f"{gguf_file.path}: yarn rope scaling needs rope.scaling.factor and "
                            f"rope.scaling.original_context_length")
    yarn: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if key(gguf_key) is not None:
            yarn[hf_key] = float(key(gguf_key))
    # yarn_attn_factor is HF's attention_factor (what the converter writes there); llama.cpp's own
    # attn_factor multiplies the temperature YaRN derives from the factor.
    if key("yarn_attn_factor") is not None:
        yarn["attention_factor"] = float(key("yarn_attn_factor")) * float(attn_factor or 1.0)
    elif attn_factor is not None:
        yarn["attention_factor"] = float(attn_factor) * (0.1 * math.log(float(factor)) + 1.0 if factor > 1 else 1.0)
    return {"rope_scaling": yarn}


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
