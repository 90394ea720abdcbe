"""A fixed pool of ``max_loras`` device slots, and the per-step batched LoRA apply.

Per target projection and layer the pool holds every slot's A and B stacked along the rank:
``a`` [in_local, S*R] and ``b`` [S*R, out_local] (S = max_loras, R = max_lora_rank, slot s in
columns/rows s*R..s*R+r, zero beyond its rank, scaling folded into b). A step's LoRA tokens, in
whatever order the batch holds them, then take one shrink and one expand matmul per projection:

    z = x[rows] @ a[:, :n*R]      every token against the step's n slots (a prefix: slots fill from 0;
                                  a one-adapter step reads only its slot's columns and needs no mask)
    z *= mask                     mask[t] keeps only the columns of token t's own slot (its slot id)
    y[rows, part] += z @ b[:n*R]

Base-model tokens are not in ``rows`` and a step without adapters skips all of it. Slots are
assigned per step (the scheduler keeps a step to max_loras adapters), reusing the least recently
used slot not needed by the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from evenflow.protocol import SchedulerOutput
from evenflow.protocol.lora import AdapterRef, LoRAConfig
from evenflow.worker.lora.host_cache import HostAdapterCache
from evenflow.worker.lora.weights import ROW_PARALLEL, HostAdapter, ProjectionShape, load_host_adapter
from evenflow.worker.parallel import TensorParallel


@dataclass(frozen=True)
class GroupPart:
    """One projection's columns in a fused output (qkv, gate_up) or a whole plain one."""

    projection: str
    start: int
    size: int


def model_layout(hidden: int, q_size: int, kv_size: int, intermediate: int, world_size: int,
                 ) -> tuple[dict[str, ProjectionShape], dict[str, tuple[GroupPart, ...]]]:
    """Full shapes of the target projections, and each fused group's parts in local columns
    (``q_size``, ``kv_size``, ``intermediate``: this rank's, as the model holds them)."""
    w = world_size
    shapes = {
        "q_proj": ProjectionShape(hidden, q_size * w), "k_proj": ProjectionShape(hidden, kv_size * w),
        "v_proj": ProjectionShape(hidden, kv_size * w), "o_proj": ProjectionShape(q_size * w, hidden),
        "gate_proj": ProjectionShape(hidden, intermediate * w), "up_proj": ProjectionShape(hidden, intermediate * w),
        "down_proj": ProjectionShape(intermediate * w, hidden),
    }
    groups = {
        "qkv": (GroupPart("q_proj", 0, q_size), GroupPart("k_proj", q_size, kv_size),
                GroupPart("v_proj", q_size + kv_size, kv_size)),
        "o": (GroupPart("o_proj", 0, hidden),),
        "gate_up": (GroupPart("gate_proj", 0, intermediate), GroupPart("up_proj", intermediate, intermediate)),
        "down": (GroupPart("down_proj", 0, hidden),),
    }
    return shapes, groups


@dataclass
class LoRAStep:
    """One step's LoRA inputs: which rows use an adapter, their slot masks, the slots in use."""

    pool: "LoRAPool"
    cols: slice  # the slot columns this step reads: slots 0..n-1, or the one slot of a one-adapter step
    rows: torch.Tensor | None  # token rows with an adapter; None: every row has one
    mask: torch.Tensor | None  # [len(rows), n * R]; None: one slot, nothing to mask
    projections: frozenset[str]  # projections some slot of the step targets

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[:, part] += LoRA(x)`` for every part of ``group`` this step's adapters target."""
        pool, rows, cols = self.pool, self.rows, self.cols
        xs = x if rows is None else x.index_select(0, rows)
        for part in pool.groups[group]:
            if part.projection not in self.projections:
                continue
            z = torch.mm(xs, pool.a[part.projection][layer, :, cols])
            if self.mask is not None:
                z.mul_(self.mask)
            delta = torch.mm(z, pool.b[part.projection][layer, cols])
            target = y[:, part.start : part.start + part.size]
            if rows is None:
                target.add_(delta)
            else:
                target.index_add_(0, rows, delta)


class LoRAPool:
    """Device slots plus the host cache they are filled from."""

    def __init__(self, config: LoRAConfig, shapes: dict[str, ProjectionShape],
                 groups: dict[str, tuple[GroupPart, ...]], num_layers: int, tp: TensorParallel,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.groups, self.num_layers = config, groups, num_layers
        self.dtype, self.device = dtype, device
        self.rank_width = config.max_lora_rank
        width = config.max_loras * config.max_lora_rank
        w = tp.world_size
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for proj, shape in shapes.items():
            in_local = shape.in_features // w if proj in ROW_PARALLEL else shape.in_features
            out_local = shape.out_features if proj in ROW_PARALLEL else shape.out_features // w
            self.a[proj] = torch.zeros(num_layers, in_local, width, dtype=dtype, device=device)
            self.b[proj] = torch.zeros(num_layers, width, out_local, dtype=dtype, device=device)
        self.slots: list[HostAdapter | None] = [None] * config.max_loras
        self._last_used = [-1] * config.max_loras
        self._steps = 0
        self.host = HostAdapterCache(
            config.max_cpu_loras,
            lambda ref: load_host_adapter(ref, shapes, num_layers, config.max_lora_rank, tp, dtype))

    def prepare_step(self, loras: Sequence[AdapterRef | None], num_scheduled: np.ndarray) -> LoRAStep | None:
        """Slots for the step's adapters (loading slots as needed) and its per-token masks.

        ``loras`` and ``num_scheduled`` are per request, in the step's token order.
        """
        distinct = {ref.identity: ref for ref in loras if ref is not None}
        if not distinct:
            return None
        self._steps += 1
        slot_of = self._assign(list(distinct.values()))
        req_slot = np.fromiter((-1 if ref is None else slot_of[ref.identity] for ref in loras), dtype=np.int64,
                               count=len(loras))
        token_slot = np.repeat(req_slot, num_scheduled)
        lora_rows = np.flatnonzero(token_slot >= 0)
        num_slots = max(slot_of.values()) + 1
        rows = None if len(lora_rows) == len(token_slot) else torch.from_numpy(lora_rows).to(self.device)
        mask = None
        r = self.rank_width
        if len(distinct) == 1:
            (slot,) = slot_of.values()
            cols = slice(slot * r, (slot + 1) * r)
        else:
            cols = slice(0, num_slots * r)
            slot_ids = torch.from_numpy(token_slot[lora_rows]).to(self.device)
            onehot = slot_ids[:, None] == torch.arange(num_slots, device=self.device)
            mask = onehot.to(self.dtype).repeat_interleave(r, dim=1)
        projections = frozenset(p for s in set(slot_of.values()) for p in self.slots[s].config.targets)  # type: ignore[union-attr]
        return LoRAStep(self, cols, rows, mask, projections)

    def _assign(self, refs: list[AdapterRef]) -> dict[str, int]:
        """identity -> slot for this step's adapters (at most max_loras of them)."""
        if len(refs) > len(self.slots):
            raise ValueError(f"a step with {len(refs)} LoRA adapters; --max-loras is {len(self.slots)}")
        resident = {adapter.ref.identity: s for s, adapter in enumerate(self.slots) if adapter is not None}
        slot_of = {ref.identity: resident[ref.identity] for ref in refs if ref.identity in resident}
        for ref in refs:
            if ref.identity in slot_of:
                continue
            taken = set(slot_of.values())
            free = [s for s, adapter in enumerate(self.slots) if adapter is None and s not in taken]
            slot = free[0] if free else min((s for s in range(len(self.slots)) if s not in taken),
                                            key=self._last_used.__getitem__)
            self._write_slot(slot, self.host.get(ref))
            slot_of[ref.identity] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._steps
        return slot_of

    def _write_slot(self, slot: int, adapter: HostAdapter) -> None:
        lo = slot * self.rank_width
        hi = lo + self.rank_width
        for proj in self.a:
            self.a[proj][:, :, lo:hi].zero_()
            self.b[proj][:, lo:hi].zero_()
        rank = adapter.config.rank
        for (proj, layer), (a_t, b_t) in adapter.tensors.items():
            self.a[proj][layer, :, lo : lo + rank].copy_(a_t)
            self.b[proj][layer, lo : lo + rank].copy_(b_t)
        self.slots[slot] = adapter

    def take_step_orders(self, so: SchedulerOutput, wait: bool) -> None:
        """Start the step's prefetches; drop unloaded adapters' slots (weights stay until overwritten)."""
        for ref in so.lora_prefetch:
            self.host.prefetch(ref)
        if so.lora_unloaded:
            gone = set(so.lora_unloaded)
            self.slots = [None if a is not None and a.ref.identity in gone else a for a in self.slots]
        self.host.collect(wait=wait)



def build_lora_pool(config: LoRAConfig | None, model: torch.nn.Module, tp: TensorParallel, dtype: torch.dtype,
                    device: torch.device) -> LoRAPool | None:
    """The pool for a Llama-family model (None when LoRA is off)."""
    if config is None:
        return None
    shapes, groups = model_layout(model.cfg.hidden_size, model.q_size, model.kv_size, model.intermediate,
                                  tp.world_size)
    return LoRAPool(config, shapes, groups, model.cfg.num_layers, tp, dtype, device)
