"""Pick the attention backend: the requested one, or the best one this machine can run."""

from __future__ import annotations

import importlib.util

import torch
from evenflow.worker.attention.base import AttentionBackend
from evenflow.worker.attention.torch_paged import TorchPagedAttention

BACKEND_NAMES = ("auto", "torch", "flash_attn", "triton")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> type[AttentionBackend]:
    """``auto``: flash_attn on CUDA when installed (half precision only), else triton on CUDA,
    else torch.

    An explicit choice the machine cannot run is an error naming what is missing.
    """
    if requested not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if requested == "torch":
        return TorchPagedAttention
    cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        if cuda and half and flash_attn_available():
            requested = "flash_attn"
        elif cuda and triton_available():
            requested = "triton"
        else:
            return TorchPagedAttention
    if not cuda:
        raise ValueError(f"attention backend {requested!r} needs a CUDA device (device is {device})")
    if requested == "flash_attn":
        if not flash_attn_available():
            raise ValueError("attention backend 'flash_attn' requested but the flash-attn package is not installed")
        if not half:
            raise ValueError(f"attention backend 'flash_attn' needs float16 or bfloat16, not {dtype}")
        from evenflow.worker.attention.flash import FlashAttention

        return FlashAttention
    if not triton_available():
        raise ValueError("attention backend 'triton' requested but the triton package is not installed")
    from evenflow.worker.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention
