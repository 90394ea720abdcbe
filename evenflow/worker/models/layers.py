"""Building blocks of Llama-family decoders: RMSNorm and the rotary embedding.

Weights live as plain tensors in small modules so that the forward pass is a short sequence of
``F.linear`` / elementwise calls without per-layer Python dispatch beyond what the math needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from evenflow.worker.config_reader import RopeScaling
from evenflow.worker.models.rope import rope_frequencies


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


def rms_norm_narrowing(x: torch.Tensor, scaled_weight: torch.Tensor, eps_root: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of float32 ``x`` returned in a narrower ``out_dtype`` (int4 projections' bfloat16 input),
    as ``x * w * sqrt(h) / hypot(|x|, sqrt(h * eps))``: five ops where F.rms_norm and the cast take eight
    (at one row each is a few microseconds of dispatch). ``scaled_weight``: weight * sqrt(hidden);
    ``eps_root``: sqrt(hidden * eps), a 0-dim tensor. Equal to ``rms_norm`` up to float32 rounding,
    which the narrowing cast drops anyway."""
    norm = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps_root)
    return torch.div(x * scaled_weight, norm).to(out_dtype)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` [tokens, heads, head_dim] with a per-head weight [heads, head_dim]."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(weight.dtype)


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
        # Full-width tables, sin signed for the first half: rotate-half RoPE is then x*cos + swap(x)*sin
        # with swap(x) = [x2, x1], three ops over the whole head instead of two per half and a cat.
        # YaRN's attention factor scales q and k alike, so it is folded into the tables.
        cos, sin = freqs.cos() * attention, freqs.sin() * attention
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
