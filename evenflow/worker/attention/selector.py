"""Pick the attention backend: the requested one, or the best one this machine can run."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re

import torch
from evenflow.worker.attention.base import AttentionBackend
from evenflow.worker.attention.torch_paged import TorchPagedAttention

BACKEND_NAMES = ("auto", "torch", "flash_attn", "triton")
# flash_attn_varlen_func takes a paged cache (block_table) from this release on.
MIN_FLASH_ATTN_VERSION = (2, 5, 7)

log = logging.getLogger("evenflow.worker.attention")


def flash_attn_problem() -> str | None:
    """Why flash-attn cannot serve here, or None when it imports and is recent enough.

    Importing is the test, not finding the package: a wheel built for another torch or CUDA is
    found but fails to load its extension, and that must fall back, not kill the worker.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    try:
        module = importlib.import_module("flash_attn")
        version_text = str(getattr(module, "__version__", "0"))
        getattr(module, "flash_attn_varlen_func")
    except Exception as e:  # ImportError, OSError (missing .so symbols), RuntimeError from CUDA init
        return f"flash-attn does not import: {type(e).__name__}: {e}"
    version = tuple(int(part) for part in re.findall(r"\d+", version_text)[:3])
    if version < MIN_FLASH_ATTN_VERSION:
        need = ".".join(map(str, MIN_FLASH_ATTN_VERSION))
        return f"flash-attn {version_text} is older than {need} (the first with a paged KV cache)"
    return None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> type[AttentionBackend]:
    """``auto``: flash_attn on CUDA when it imports (half precision only), else triton on CUDA,
    else torch. A flash-attn that is installed but unusable is logged and skipped.

    An explicit choice the machine cannot run is an error naming what is missing.
    """
    if requested not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if requested == "torch":
        return TorchPagedAttention
    cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        flash_problem = flash_attn_problem() if cuda and half else "not needed"
        if flash_problem is None:
            requested = "flash_attn"
        else:
            if cuda and half and importlib.util.find_spec("flash_attn") is not None:
                log.warning("not using flash-attn (%s); falling back to %s", flash_problem,
                            "triton" if triton_available() else "torch")
            if cuda and triton_available():
                requested = "triton"
            else:
                return TorchPagedAttention
    if not cuda:
        raise ValueError(f"attention backend {requested!r} needs a CUDA device (device is {device})")
    if requested == "flash_attn":
        problem = flash_attn_problem()
        if problem is not None:
            raise ValueError(f"attention backend 'flash_attn' requested but {problem}")
        if not half:
            raise ValueError(f"attention backend 'flash_attn' needs float16 or bfloat16, not {dtype}")
        from evenflow.worker.attention.flash import FlashAttention

        return FlashAttention
    if not triton_available():
        raise ValueError("attention backend 'triton' requested but the triton package is not installed")
    from evenflow.worker.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention
