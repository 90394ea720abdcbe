"""Building blocks of Llama-family decoders: RMSNorm and the rotary embedding.

Weights live as plain tensors in small modules so that the forward pass is a short sequence of
``F.linear`` / elementwise calls without per-layer Python dispatch beyond what the math needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from evenflow.worker.config_reader import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 like the reference implementation, returned
    in ``out_dtype`` (default: ``x``'s; the next projection's input dtype, so it reads it uncast)."""
    if x.dtype == torch.float32:
        out = F.rms_norm(x, weight.shape, weight, eps)
    else:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * xf.to(x.dtype)
    return out if out_dtype is None or out.dtype == out_dtype else out.to(out_dtype)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` [tokens, heads, head_dim] with a per-head weight [heads, head_dim]."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(weight.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with the ``llama3`` rescaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


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
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        # Full-width tables, sin signed for the first half: rotate-half RoPE is then x*cos + swap(x)*sin
        # with swap(x) = [x2, x1], three ops over the whole head instead of two per half and a cat.
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype=dtype, device=device)
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, signed sin), each [num_tokens, 1, head_dim], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` [tokens, heads, head_dim] with ``RotaryTable.lookup``'s tables; returns a
    new contiguous tensor in the tables' dtype (a narrower ``x``, such as int4 projections' bfloat16
    output, is widened by the multiply)."""
    *lead, d = x.shape
    swapped = x.view(*lead, 2, d // 2).flip(-2).view(*lead, d)
    return torch.addcmul(x * cos, swapped, sin)
