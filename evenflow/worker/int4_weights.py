"""Which GGUF tensors stay 4-bit: the loader offers each raw tensor here before dequantizing it.

``--quantization`` (vLLM's flag): ``none`` dequantizes everything to ``--dtype`` (the exact
float32 reference path); ``gguf`` keeps Q4_0/Q4_1 projections 4-bit. Unset, it follows ``--dtype``:
with ``auto`` (the default) they are kept 4-bit and the model drops them back to dense at load if
the start-up measurement finds the int4 kernel slower than float32 on this CPU (see
evenflow/worker/models/int4_linear.py); an explicit ``--dtype float32`` (or bfloat16, float16) asks
for weights in that dtype and gets them dequantized. Embeddings and the LM head are never offered:
they stay as the GGUF holds them, dequantized.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from evenflow.worker.models.llama import LlamaModel
from evenflow.worker.models.weight_specs import WeightSpec
from evenflow.worker.models.q4_blocks import INT4_TYPES, split_blocks

QUANTIZATION_CHOICES = (None, "gguf", "none")


def effective_quantization(quantization: str | None, requested_dtype: str) -> str | None:
    """``--quantization`` as given, or for an unset one: None (keep 4-bit where faster) under
    ``--dtype auto``, ``none`` under an explicit dtype."""
    if quantization is not None or requested_dtype == "auto":
        return quantization
    return "none"


def check_quantization(quantization: str | None) -> None:
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; choose gguf or none (or leave it unset)")


def prepare_int4(model: LlamaModel, quantization: str | None) -> set[str]:
    """Set the model up for this load; return the parameters whose 4-bit rows it may keep."""
    check_quantization(quantization)
    model.int4_required = quantization == "gguf"
    if quantization == "none":
        return set()
    params = model.int4_params()
    if quantization == "gguf" and not params:
        raise ValueError("--quantization gguf keeps 4-bit weights on one CPU worker only "
                         "(not with tensor parallelism or on CUDA)")
    return params


def offer_int4(model: LlamaModel, int4_params: set[str], spec: WeightSpec, qtype: GGMLQuantizationType,
               data: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Keep one raw GGUF tensor 4-bit if it is a Q4 projection; False: the caller dequantizes it."""
    if spec.param not in int4_params or qtype not in INT4_TYPES or len(shape) != 2:
        return False
    model.load_int4_part(spec.param, spec.row_offset, split_blocks(qtype, data, (shape[0], shape[1])))
    return True
