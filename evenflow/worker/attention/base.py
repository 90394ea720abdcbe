"""The interface every attention backend implements, and the step inputs they all share.

A step's flat varlen layout (DESIGN.md "One step of the worker"): tokens of all scheduled
requests concatenated, ``query_start_loc`` delimiting them. The runner orders requests so that
decode-only ones (one new token each) come first: backends that batch decodes can then slice
``[:num_decodes]`` instead of gathering.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [num_blocks, block_size, kv_heads, head_dim]


@dataclass
class AttentionInputs:
    """What one step's attention needs, built once per step and shared by every layer."""

    num_tokens: int
    num_reqs: int
    num_decodes: int  # the first num_decodes requests have exactly one new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: computed + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device, trimmed to what the step needs
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: where each new token's K/V goes
    # Host copies, for backends that plan work in Python once per step.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    block_table_np: np.ndarray


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and attends each query to its context."""

    name: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")  # where the KV cache lives
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_dtype = kv_dtype
        # K and V bytes of one token in one layer.
        self.kv_bytes_per_token = 2 * num_kv_heads * head_dim * torch.empty(0, dtype=kv_dtype).element_size()

    @staticmethod
    def block_size_for(requested: int) -> int:
        """The KV block size this backend will use when the engine asks for ``requested``."""
        return requested

    @abstractmethod
    def plan(self, inputs: AttentionInputs) -> Any:
        """Precompute per-step structures (index tensors, masks) reused by every layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, plan: Any
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the new tokens; returns the attention output [T, H * D]."""


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their physical slots (block * block_size + offset)."""
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
