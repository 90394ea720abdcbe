"""Portable attention over the paged KV cache with PyTorch ops (the CPU path and the reference).

Per step, ``plan`` precomputes everything index-shaped once (block gathers, masks); each layer then
does: one ``index_copy_`` pair to store K/V, one batched SDPA for all decode-only requests, and one
SDPA per prefill chunk.

* Decodes on a bfloat16 cache on CPU (int4 projections' cache, ``--dtype bfloat16``): one call of a C++
  kernel for all of them, reading each request's blocks in place (cpu_decode.py); 0.24-0.73x the time of
  PyTorch's attention with the gather below, per layer. Chunks on such a cache, where the CPU has AMX: one call
  of a C++ kernel for all of them, their keys read in place (cpu_prefill.py); 0.42x PyTorch's time on a
  2048-token prompt. Elsewhere, and where the kernels do not build:
* Decodes: each group's contexts are gathered block-wise into [B, L, Hkv, D] (L = the group's
  longest context rounded up to blocks) and attended in one call, with a padding mask. The runner
  sorts decodes by length, and they are cut into small contiguous groups
  so that each group's gathered K/V stays in cache. GQA needs no K/V repetition: the query is viewed as
  [B, Hkv, G, D], the G heads sharing a KV head acting as G "query positions".
* Prefill chunks with no earlier context attend to their own fresh K/V, causally (no gather).
* Chunks that continue a prompt (chunked prefill, prefix-cache hit), on CPU: attention over the cached
  context (every key visible: no mask) and over the chunk's own fresh K/V (causal), merged by their
  log-sum-exps. A [q, context] mask grew with the context (built per step, read by every layer),
  and SDPA's GQA repeats K/V per query head; unmasked, the context part views the G query heads that
  share a KV head as G x q query rows of that head and reads each gathered key once for all of them.
  Elsewhere (the portable reference) they gather their context and use a bottom-right causal mask.
* In place: a context whose blocks are one range of block ids (in any order: a lone stream's blocks
  come off the free queue in runs, and a new block is the successor of the one before where nothing
  there can be hit: ``BlockPool.get_new_blocks``) is read as a view of that range, no gather. Keys are visible in
  any order, so the order only decides which slots a key mask hides (the last block's unused tail).
  On a 2-core Xeon a lone decode's attention took 17 against 34 us a layer at 130 tokens of context,
  130 against 317 at 2,000 (`scripts/probe_kernel_choices.py --only attention`: gathered copies are
  written and read again, and at 2 threads the small copies pay the threads' wake-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from evenflow.worker.attention.base import AttentionBackend, AttentionInputs, KVCache, write_kv
from evenflow.worker.attention.cpu_decode import PagedDecodeKernel
from evenflow.worker.attention.cpu_prefill import PREFILL_KERNEL_MIN_ROWS, PagedPrefillKernel


@dataclass
class _ChunkPlan:
    """One request with more than one new token."""

    q_start: int
    q_end: int
    context_len: int  # split path: the cached tokens before the chunk; masked path: cached + chunk
    block_ids: torch.Tensor | None  # [num_blocks] long; None when the chunk has no earlier context
    mask: torch.Tensor | None  # [q_len, context_len] additive (0 / -inf); None on the split path
    # Split path, read in place: the context's first block id, and a key mask [1, 1, 1, blocks * size]
    # when the range holds slots outside the context in the middle (None: its first context_len slots).
    first_block: int | None = None
    key_mask: torch.Tensor | None = None


@dataclass
class _DecodeGroup:
    """Decode requests [start, end) (one token each), padded to ``blocks_per_req`` blocks."""

    start: int
    end: int
    blocks_per_req: int
    block_ids: torch.Tensor | None  # [(end - start) * blocks_per_req] long; None when read in place
    mask: torch.Tensor  # [end - start, 1, 1, blocks_per_req * block_size] additive (0 / -inf)
    first_block: int | None = None  # one request whose blocks are this id on: read in place, mask in that order


@dataclass
class _KernelDecodes:
    """The step's decodes [0, num) for the C++ kernel, which reads their blocks in place."""

    num: int
    block_table: torch.Tensor  # [num, >= blocks] int32
    seq_lens: torch.Tensor  # [num] int32


@dataclass
class _KernelChunks:
    """The step's chunks (requests [num_decodes, num_reqs)) for the C++ prefill kernel, which reads their
    keys in place."""

    chunks: torch.Tensor  # PagedPrefillKernel.chunk_table
    block_table: torch.Tensor  # [num_reqs, >= blocks] int32


@dataclass
class TorchAttentionPlan:
    slot_mapping: torch.Tensor
    decode_groups: list[_DecodeGroup]
    chunks: list[_ChunkPlan]
    kernel_decodes: _KernelDecodes | None = None
    kernel_chunks: _KernelChunks | None = None


# Decodes are attended in groups whose gathered K/V stay cache-resident (about L2-sized): one
# gather of every context at once goes through DRAM twice and measured ~2x slower per token.
GROUP_TARGET_BYTES = 3 << 20


def split_decode_groups(sorted_lens: np.ndarray, block_size: int, bytes_per_token: int) -> list[tuple[int, int]]:
    """Cut decodes (sorted by context length) into contiguous groups of at most
    ``GROUP_TARGET_BYTES`` of gathered K/V each (always at least one request per group)."""
    padded = (-(-sorted_lens // block_size) * block_size).tolist()
    spans: list[tuple[int, int]] = []
    start = 0
    for i, length in enumerate(padded):
        if i > start and (i - start + 1) * length * bytes_per_token > GROUP_TARGET_BYTES:
            spans.append((start, i))
            start = i
    spans.append((start, len(padded)))
    return spans


def in_place_range(block_ids: np.ndarray, visible_len: int, block_size: int) -> tuple[int, np.ndarray] | None:
    """Whether a context can be read in place: (its first block id, which slots of the range
    ``[first, first + len(block_ids))`` hold its first ``visible_len`` tokens, in the range's order),
    or None when its block ids are not one range. ``block_ids``: the context's blocks in token order."""
    first = int(block_ids.min())
    if int(block_ids.max()) - first != len(block_ids) - 1:  # a request's block ids are distinct
        return None
    logical = np.empty(len(block_ids), dtype=np.int64)
    logical[block_ids - first] = np.arange(len(block_ids))  # range position -> the block's place in the context
    tokens = logical[:, None] * block_size + np.arange(block_size)[None, :]
    return first, (tokens < visible_len).reshape(-1)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, kv_dtype, device)
        # A bfloat16 cache on CPU: decodes and chunks by the C++ kernels (cpu_decode.py, cpu_prefill.py), where
        # they build (the prefill kernel: with AMX).
        self.decode_kernel = PagedDecodeKernel(num_heads, num_kv_heads, head_dim, kv_dtype, self.device)
        self.prefill_kernel = PagedPrefillKernel(num_heads, num_kv_heads, head_dim, kv_dtype, self.device)

    def plan(self, inputs: AttentionInputs) -> TorchAttentionPlan:
        device = inputs.slot_mapping.device
        bs = inputs.block_size
        qsl = inputs.query_start_loc_np
        seq_lens = inputs.seq_lens_np
        nd = inputs.num_decodes
        groups: list[_DecodeGroup] = []
        kernel_decodes = None
        if nd and self.decode_kernel.available and device.type == "cpu":
            kernel_decodes = _KernelDecodes(nd, inputs.block_table[:nd], inputs.seq_lens[:nd])
            self.decode_kernel.check_tables(kernel_decodes.block_table, kernel_decodes.seq_lens)
        elif nd:
            for start, end in split_decode_groups(seq_lens[:nd], bs, self.kv_bytes_per_token):
                nb = int(-(-int(seq_lens[start:end].max()) // bs))
                place = None
                if end - start == 1 and device.type == "cpu":
                    place = in_place_range(inputs.block_table_np[start, :nb], int(seq_lens[start]), bs)
                if place is not None:
                    first, visible_np = place
                    mask = self._additive(torch.from_numpy(visible_np)).view(1, 1, 1, -1)
                    groups.append(_DecodeGroup(start, end, nb, None, mask, first))
                    continue
                block_ids = inputs.block_table[start:end, :nb].to(torch.long).reshape(-1)
                lens = inputs.seq_lens[start:end].to(torch.long)
                visible = torch.arange(nb * bs, device=device)[None, :] < lens[:, None]
                mask = self._additive(visible).view(end - start, 1, 1, -1)
                groups.append(_DecodeGroup(start, end, nb, block_ids, mask))
        chunks: list[_ChunkPlan] = []
        kernel_rows: list[tuple[int, int, int, int]] = []  # PagedPrefillKernel.chunk_table's
        takes_kernel = self.prefill_kernel.available and bs % 16 == 0 and device.type == "cpu"
        for i in range(nd, inputs.num_reqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            q_len = end - start
            context_len = int(seq_lens[i])
            if takes_kernel and q_len >= PREFILL_KERNEL_MIN_ROWS:
                kernel_rows.append((start, q_len, context_len, i))
                continue
            if context_len == q_len:
                chunks.append(_ChunkPlan(start, end, context_len, None, None))
                continue
            if device.type == "cpu":  # the split path: the cached context alone, no mask
                cached = context_len - q_len
                nb = -(-cached // bs)
                place = in_place_range(inputs.block_table_np[i, :nb], cached, bs)
                if place is None:
                    chunks.append(_ChunkPlan(start, end, cached, inputs.block_table[i, :nb].to(torch.long), None))
                    continue
                first, visible_np = place
                prefix = bool(visible_np[:cached].all())  # the tokens fill the range's first slots
                key_mask = None if prefix else self._additive(torch.from_numpy(visible_np)).view(1, 1, 1, -1)
                chunks.append(_ChunkPlan(start, end, cached, None, None, first, key_mask))
                continue
            num_blocks = -(-context_len // bs)
            block_ids = inputs.block_table[i, :num_blocks].to(torch.long)
            q_pos = torch.arange(context_len - q_len, context_len, device=device)
            visible = torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]
            chunks.append(_ChunkPlan(start, end, context_len, block_ids, self._additive(visible)))
        kernel_chunks = None
        if kernel_rows:
            kernel_chunks = _KernelChunks(PagedPrefillKernel.chunk_table(kernel_rows), inputs.block_table)
        return TorchAttentionPlan(inputs.slot_mapping, groups, chunks, kernel_decodes, kernel_chunks)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Bool mask -> additive float mask (0 / -inf), built once per step rather than converted
        by SDPA in every layer."""
        mask = torch.zeros(visible.shape, dtype=self.kv_dtype, device=visible.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, plan: TorchAttentionPlan
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, plan.slot_mapping)
        num_tokens = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        k_cache, v_cache = kv_cache
        whole = len(plan.decode_groups) == 1 and not plan.chunks and plan.kernel_chunks is None
        out = None if whole else torch.empty(num_tokens, self.num_heads * d, dtype=q.dtype, device=q.device)
        if plan.kernel_decodes is not None:
            kd = plan.kernel_decodes
            self.decode_kernel(q[: kd.num], k_cache, v_cache, kd.block_table, kd.seq_lens, out, self.scale)
        if plan.kernel_chunks is not None:
            kc = plan.kernel_chunks
            self.prefill_kernel(q, k_cache, v_cache, kc.block_table, kc.chunks, out, self.scale)
        for g in plan.decode_groups:
            b = g.end - g.start
            length = g.blocks_per_req * k_cache.shape[1]
            if g.first_block is None:
                kc = k_cache.index_select(0, g.block_ids).view(b, length, hkv, d).transpose(1, 2)
                vc = v_cache.index_select(0, g.block_ids).view(b, length, hkv, d).transpose(1, 2)
            else:
                blocks = slice(g.first_block, g.first_block + g.blocks_per_req)
                kc = k_cache[blocks].view(1, length, hkv, d).transpose(1, 2)
                vc = v_cache[blocks].view(1, length, hkv, d).transpose(1, 2)
            qd = q[g.start : g.end].view(b, hkv, group, d)
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=g.mask, scale=self.scale)
            if whole:  # the step is this one group of decodes: its output is the step's, no copy
                return o.reshape(b, self.num_heads * d)
            out[g.start : g.end] = o.reshape(b, self.num_heads * d)
        for c in plan.chunks:
            # 4-D [1, H, n, D]: PyTorch's fused CPU kernel takes only batched inputs; 3-D inputs with a
            # mask fall back to the math path, 1.8x slower on a 256 x 2048 chunk (bench_cpu_kernels.py).
            qc = q[c.q_start : c.q_end].transpose(0, 1)[None]
            if c.block_ids is None and c.first_block is None:
                kc = k[c.q_start : c.q_end].transpose(0, 1)[None]
                vc = v[c.q_start : c.q_end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True)
            elif c.mask is None:
                o = self._split_chunk(qc, k[c.q_start : c.q_end], v[c.q_start : c.q_end], kv_cache, c)
            else:
                kc = k_cache.index_select(0, c.block_ids).view(-1, hkv, d)[: c.context_len].transpose(0, 1)[None]
                vc = v_cache.index_select(0, c.block_ids).view(-1, hkv, d)[: c.context_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=self.scale, enable_gqa=True)
            out[c.q_start : c.q_end] = o[0].transpose(0, 1).reshape(c.q_end - c.q_start, self.num_heads * d)
        return out

    def _split_chunk(self, qc: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: KVCache,
                     c: _ChunkPlan) -> torch.Tensor:
        """A chunk after ``c.context_len`` cached tokens: qc [1, H, n, D], k/v_new [n, Hkv, D] -> [1, H, n, D]."""
        hkv, d = self.num_kv_heads, self.head_dim
        n = qc.shape[2]
        group = self.num_heads // hkv
        k_cache, v_cache = kv_cache
        if c.first_block is None:
            kc = k_cache.index_select(0, c.block_ids).view(-1, hkv, d)[: c.context_len].transpose(0, 1)[None]
            vc = v_cache.index_select(0, c.block_ids).view(-1, hkv, d)[: c.context_len].transpose(0, 1)[None]
        else:
            blocks = slice(c.first_block, c.first_block + -(-c.context_len // k_cache.shape[1]))
            keys = slice(None) if c.key_mask is not None else slice(c.context_len)
            kc = k_cache[blocks].view(-1, hkv, d)[keys].transpose(0, 1)[None]
            vc = v_cache[blocks].view(-1, hkv, d)[keys].transpose(0, 1)[None]
        # Heads h = kv * G + g: [1, Hkv, G * n, D], every row of a KV head against the same keys.
        grouped = qc.reshape(1, hkv, group * n, d)
        o_ctx, lse_ctx = _flash_cpu(grouped, kc, vc, 0.0, False, attn_mask=c.key_mask, scale=self.scale)
        o_ctx, lse_ctx = o_ctx.reshape(1, self.num_heads, n, d), lse_ctx.reshape(1, self.num_heads, n, 1)
        o_new, lse_new = _flash_cpu(qc, k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None], 0.0, True,
                                    scale=self.scale)
        # Softmax over both key sets = each part weighted by its share of the total exp-sum: one lerp in
        # float32 (a bfloat16 cache's outputs rounded once, not at each of three bfloat16 ops).
        w_ctx = torch.sigmoid(lse_ctx - lse_new.reshape(1, self.num_heads, n, 1))
        return torch.lerp(o_new.float(), o_ctx.float(), w_ctx).to(o_ctx.dtype)


# PyTorch's fused CPU attention, which also returns each query's log-sum-exp (F.scaled_dot_product_attention
# dispatches to it on CPU but keeps the log-sum-exp to itself). GQA with fewer KV heads is native.
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
