"""Rotary embedding frequencies with the scalings llama-family checkpoints carry.

Each follows transformers' ``modeling_rope_utils`` (the reference the tests compare against):
``linear`` (every frequency divided by ``factor``), ``yarn`` (NTK-by-parts: frequencies that turn
fewer than ``beta_slow`` times in the original context are interpolated, more than ``beta_fast``
kept, a linear ramp between, and cos/sin scaled by ``attention_factor``), ``llama3`` (long
wavelengths slowed by ``factor``, a smooth band between), and ``freq_factors``: llama.cpp's
per-frequency divisors, the ``rope_freqs.weight`` tensor its converter writes for llama3 models.
"""

from __future__ import annotations

import math

import torch
from evenflow.worker.config_reader import RopeScaling


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, the factor cos and sin are multiplied by)."""
    inv_freq = base_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if scaling.rope_type == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    original = float(s.original_max_position_embeddings)
    low_wavelen = original / s.low_freq_factor
    high_wavelen = original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    original = float(s.original_max_position_embeddings)

    def correction_dim(rotations: float) -> float:
        # The dimension whose frequency turns `rotations` times over the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp, not a division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = 1.0 / (s.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    attention = s.attention_factor
    if attention is None:
        attention = (yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else yarn_mscale(s.factor))
    return inv_freq, float(attention)
