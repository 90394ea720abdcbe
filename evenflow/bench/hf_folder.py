"""An HF folder (config.json, model.safetensors, tokenizer) made from a GGUF by transformers' own
GGUF loader: the reference side for peft, and what the LoRA benchmark trains and serves on.

transformers refuses to ``save_pretrained`` a model it dequantized from a GGUF, so the state dict,
config and tokenizer are written one by one (tied embeddings stay tied: no lm_head tensor). The
config names its architecture (the config of a GGUF-loaded model has none, and vLLM needs it)
and no quantization (the weights are dequantized).

    python -m evenflow.bench.hf_folder MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def hf_folder_from_gguf(gguf: Path, out: Path) -> Path:
    """``out`` holding the float32 HF folder of ``gguf`` (made once; reused when present)."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    # The weights written are plain float32: no "gguf" quantization_config (vLLM refuses that method).
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m evenflow.bench.hf_folder MODEL.gguf OUT_DIR")
    print(hf_folder_from_gguf(Path(sys.argv[1]), Path(sys.argv[2])))
