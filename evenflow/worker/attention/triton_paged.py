"""Paged varlen attention as one Triton kernel (CUDA machines without flash-attn).

One program per (request, tile of BLOCK_M new tokens, query head). It walks the request's block
table one KV block at a time (the block is the key tile), with an online softmax, masking keys
after each query's own position (causal inside the new chunk, everything before it visible).
Decodes are simply requests with one new token. New K/V are stored with ``write_kv`` first.

Also runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests use that when triton is installed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from evenflow.worker.attention.base import AttentionBackend, AttentionInputs, KVCache, write_kv


# Triton compiles a variant per value class of each int argument (1, divisible by 16, other).
# The block table's row stride is its width, which changes every step: not specializing on it
# leaves two variants (BLOCK_M 16 and 64), both compiled by the runner's warm-up.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    Q, K_cache, V_cache, Out, block_table, query_start_loc, seq_lens, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // QUERIES_PER_KV
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens + req)
        first_pos = seq_len - q_len  # position of the request's first new token
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_SIZE)
        m_valid = offs_m < q_len
        d_valid = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        q_pos = first_pos + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys past this tile's last query are never visible to it.
        kv_end = tl.minimum(seq_len, first_pos + (m_block + 1) * BLOCK_M)
        for b in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
            phys = tl.load(block_table + req * stride_bt + b).to(tl.int64)
            kv_offs = phys * stride_kb + offs_n[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
            k = tl.load(K_cache + kv_offs, mask=d_valid[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            k_pos = b * BLOCK_SIZE + offs_n
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_cache + kv_offs, mask=d_valid[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


@dataclass
class TritonAttentionPlan:
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    block_m: int
    num_m_blocks: int


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    @staticmethod
    def block_size_for(requested: int) -> int:
        """A power of two of at least 16 (the key tile is one block; tl.dot needs >= 16)."""
        return max(16, triton.next_power_of_2(requested))

    def plan(self, inputs: AttentionInputs) -> TritonAttentionPlan:
        block_m = 16 if inputs.max_query_len <= 16 else 64
        return TritonAttentionPlan(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_table=inputs.block_table.contiguous(),
            num_reqs=inputs.num_reqs,
            block_m=block_m,
            num_m_blocks=triton.cdiv(inputs.max_query_len, block_m),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, plan: TritonAttentionPlan
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, plan.slot_mapping)
        k_cache, v_cache = kv_cache
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        grid = (plan.num_reqs, plan.num_m_blocks, self.num_heads)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, plan.block_table, plan.query_start_loc, plan.seq_lens, self.scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1), plan.block_table.stride(0),
            QUERIES_PER_KV=self.num_heads // self.num_kv_heads, BLOCK_M=plan.block_m,
            BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=self.head_dim, BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
