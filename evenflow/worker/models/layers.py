"""Building blocks of Llama-family decoders: RMSNorm and the rotary embedding.

Weights live as plain tensors in small modules so that the forward pass is a short sequence of
``F.linear`` / elementwise calls without per-layer Python dispatch beyond what the math needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from evenflow.worker.config_reader import RopeScaling
from evenflow.worker.models.rope import rope_frequencies


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 like the reference implementation."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` [tokens, heads, head_dim] with a per-head weight [heads, head_dim]."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class RotaryTable:
    """cos/sin for every position up to ``max_positions``, computed once.

    ``lookup(positions)`` is called once per forward and its result shared by every layer.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq, attention = rope_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        # Half-width tables: rotate-half RoPE uses the same angle for dims i and i + D/2.
        # YaRN's attention factor scales q and k alike, so it is folded into the tables.
        self.cos = (freqs.cos() * attention).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * attention).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin), each [num_tokens, 1, head_dim/2], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` [tokens, heads, head_dim]; returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
