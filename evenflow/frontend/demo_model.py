"""The built-in demo model: a seeded random-weight Llama with a real BPE tokenizer.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
the Python standard library's own top-level ``.py`` sources (sorted, first few MB: deterministic for
a given Python version); the weights are drawn with numpy from a seed and written with
``safetensors.numpy``. The weights are random, so the text is gibberish; the point is a model that
exercises the whole serving path (tokenizer, chat template, streaming) and starts fast.

    python -m evenflow.frontend.demo_model --out DIR [--preset tiny|small] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

# Special tokens take the first ids; ChatML markers make the chat template readable.
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_BYTES = 3 * 1024 * 1024
RANDOM_WEIGHTS_NOTE = "the demo model's weights are RANDOM: its text is gibberish"


@dataclass(frozen=True)
class DemoPreset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    dtype: str = "float32"


PRESETS: dict[str, DemoPreset] = {
    "tiny": DemoPreset(256, 4, 4, 2, 768),
    "small": DemoPreset(1024, 8, 16, 4, 2816, dtype="float16"),
}


def default_demo_dir(preset: str = "tiny") -> Path:
    """``$XDG_CACHE_HOME/evenflow/demo-model`` (``~/.cache`` when unset); other presets get a suffix."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = "demo-model" if preset == "tiny" else f"demo-model-{preset}"
    return Path(cache) / "evenflow" / name


def ensure_demo_model(out: Path | None = None, preset: str = "tiny", seed: int = 0) -> Path:
    """Return the demo model folder, writing it first if it is not there yet."""
    out = Path(out) if out is not None else default_demo_dir(preset)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    write_demo_model(out, preset=preset, seed=seed)
    return out


def write_demo_model(out: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write tokenizer, config and random weights into ``out`` atomically (tmp dir, then rename)."""
    spec = PRESETS[preset]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is ordinary data
    try:
        tokenizer = train_tokenizer(spec.vocab_size)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        _write_json(tmp / "config.json", _model_config(spec))
        _write_json(tmp / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
        _write_weights(tmp / "model.safetensors", spec, seed)
        if out.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def training_text() -> Iterator[str]:
    """The stdlib's top-level sources in sorted order, up to TRAINING_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= TRAINING_BYTES:
            return


def train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE (GPT-2 style) with SPECIAL_TOKENS at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _model_config(spec: DemoPreset) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": spec.dtype,
        "evenflow_note": RANDOM_WEIGHTS_NOTE,
    }


def _write_weights(path: Path, spec: DemoPreset, seed: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    dtype = np.dtype(spec.dtype)
    h, ffn, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def normal(*shape: int) -> np.ndarray:
        # std 0.05 keeps activations bounded over a few layers while logits still differ.
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(dtype)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, h)
        tensors[p + "mlp.gate_proj.weight"] = normal(ffn, h)
        tensors[p + "mlp.up_proj.weight"] = normal(ffn, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, ffn)
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=dtype)
    tensors["model.norm.weight"] = np.ones(h, dtype=dtype)
    tensors["lm_head.weight"] = normal(v, h)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write evenflow's demo model (random weights).")
    parser.add_argument("--out", type=Path, default=None, help="folder (default: the user cache)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = ensure_demo_model(args.out, preset=args.preset, seed=args.seed)
    print(f"demo model ({args.preset}) at {out}; {RANDOM_WEIGHTS_NOTE}")


if __name__ == "__main__":
    main()
