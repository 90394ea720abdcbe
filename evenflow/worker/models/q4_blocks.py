"""GGUF Q4_0 / Q4_1 blocks as torch's CPU int4 kernel wants them, and back.

A GGUF row of ``k`` values is ``k / 32`` blocks. Q4_1: ``d`` (fp16), ``m`` (fp16), 16 bytes of
4-bit ``q`` (value ``q*d + m``); Q4_0: ``d`` and the 16 bytes (value ``(q-8)*d``). In a block,
value ``j < 16`` is the low nibble of byte ``j`` and value ``j + 16`` its high nibble.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes with groups of 32 along ``k`` and one
(scale, zero) per group and output row, value ``(q-8)*scale + zero``. So a Q4_1 block is exactly
a group with scale ``d`` and zero ``m + 8d``, and a Q4_0 block one with zero 0: the 4-bit values
are taken as they are, nothing is requantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from gguf import GGMLQuantizationType

GROUP = 32  # values per GGUF block, and the int4 kernel's group size
# Rows an int4 weight is padded to a multiple of: the largest tile of torch's CPU int4 layouts.
PACK_TILE_ROWS = 64
# The tile heights torch's CPU int4 packing uses, by the vector ISA ATen dispatches to: 64 rows on
# AVX-512, 32 on AVX2. In both, byte (tile, k, d) holds row tile*T + d (low nibble) and row
# tile*T + T/2 + d (high nibble).
TILE_ROWS_BY_ISA = (64, 32)
BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
INT4_TYPES = frozenset(BLOCK_BYTES)


@dataclass(frozen=True)
class Q4Rows:
    """Rows of a Q4 tensor split into the kernel's parts: 4-bit values and per-group scale/zero."""

    q: torch.Tensor  # uint8 [rows, k], values 0..15
    scale: torch.Tensor  # float32 [rows, k / 32]
    zero: torch.Tensor  # float32 [rows, k / 32]

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def values(self) -> torch.Tensor:
        """float32 values [rows, k] (for a weight that ends up dense after all)."""
        n, k = self.q.shape
        q = self.q.float().view(n, k // GROUP, GROUP)
        return ((q - 8) * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)


@dataclass(frozen=True)
class Int4Weight:
    """A projection weight [out_features, in_features] packed once for the CPU int4 kernel."""

    packed: torch.Tensor  # uint8, torch's CPU int4 layout
    scale_zeros: torch.Tensor  # bfloat16 [in_features / 32, out_features, 2]
    out_features: int
    in_features: int
    # The same values dequantized once, for many-row steps (the plan's): a tensor, or FBGEMM's packed float16.
    dense: torch.Tensor | torch.ScriptObject | None = None
    # scale_zeros in the AVX2 GEMV's strip order (models/int4_gemv.py's ``gemv_layout``), where it runs here.
    strip_scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes a step on the int4 kernel reads (a dense copy is read only by many-row steps)."""
        return self.packed.nbytes + self.scale_zeros.nbytes

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """Write the weight's values [out_features, in_features] into ``out`` (its dtype) and return it.

        Byte ``(tile, k, d)`` of the packed tiles holds row ``tile*T + d`` (low nibble) and row
        ``tile*T + T/2 + d`` (high nibble), T this CPU's tile height (``pack_tile_rows``); ``out`` is
        reused across layers, so a step allocates nothing the size of a weight."""
        n, k = self.out_features, self.in_features
        rows = pack_tile_rows()
        if rows is None:
            raise RuntimeError("this torch's int4 packing is not a layout evenflow reads")
        tiles = self.packed.view(n // rows, k, rows // 2)
        halves = out.view(n // rows, 2, rows // 2, k)
        # Transposed as bytes first: a transposing copy that also converts the dtype is 2x slower.
        halves[:, 0].copy_((tiles & 15).transpose(1, 2).contiguous())
        halves[:, 1].copy_((tiles >> 4).transpose(1, 2).contiguous())
        scale = self.scale_zeros[..., 0].t().float()
        offset = self.scale_zeros[..., 1].t().float() - 8 * scale  # (q-8)*s + z == q*s + (z - 8s)
        groups = out.view(n, k // GROUP, GROUP)
        groups.mul_(scale.to(out.dtype).unsqueeze(-1)).add_(offset.to(out.dtype).unsqueeze(-1))
        return out


def split_blocks(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int]) -> Q4Rows:
    """Raw Q4_0/Q4_1 bytes ``[rows, bytes per row]`` (a GGUF tensor's data) -> ``Q4Rows``."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{qtype.name} is not a 4-bit type this kernel reads ({', '.join(t.name for t in INT4_TYPES)})")
    rows, k = shape
    if k % GROUP:
        raise ValueError(f"in_features={k} is not a multiple of the {GROUP}-value block")
    blocks = np.ascontiguousarray(data).reshape(rows, k // GROUP, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(rows, k)
    return Q4Rows(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def concat_rows(parts: list[Q4Rows]) -> Q4Rows:
    """Fused projections (qkv, gate_up): the parts' rows one after the other."""
    if len(parts) == 1:
        return parts[0]
    return Q4Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                  torch.cat([p.zero for p in parts]))


def pack(rows: Q4Rows) -> Int4Weight:
    """Pack once at load; the scale and zero go to bfloat16, the activations' dtype in the kernel."""
    n, k = rows.q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows.q.to(torch.int32), 1)
    scale_zeros = torch.stack((rows.scale.t(), rows.zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(packed, scale_zeros, n, k)


@cache
def pack_tile_rows() -> int | None:
    """The tile height of this process's int4 packing (None: no layout evenflow reads, or no kernel).

    Found by packing a probe and unpacking it with each known height: which layout torch writes
    depends on the CPU it runs on (and ``ATEN_CPU_CAPABILITY``), not on the torch build."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (2 * PACK_TILE_ROWS, 2 * GROUP), dtype=torch.int32, generator=g)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError):
        return None
    n, k = q.shape
    for rows in TILE_ROWS_BY_ISA:
        tiles = packed.view(n // rows, k, rows // 2)
        unpacked = torch.cat(((tiles & 15).transpose(1, 2), (tiles >> 4).transpose(1, 2)), dim=1)
        if torch.equal(unpacked.reshape(n, k).to(torch.int32), q):
            return rows
    return None
