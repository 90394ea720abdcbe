"""Attention through flash-attn's ``flash_attn_varlen_func`` on the paged cache (CUDA).

The whole step is one call per layer: queries concatenated (``cu_seqlens_q``), each request's
keys read from its block table (``cu_seqlens_k`` from the context lengths), causal with the
bottom-right alignment flash-attn uses when a query chunk is shorter than its context. flash-attn
2's paged KV needs blocks of a multiple of 256 tokens, so this backend picks such a block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from evenflow.worker.attention.base import AttentionBackend, AttentionInputs, KVCache, write_kv
from flash_attn import flash_attn_varlen_func

FLASH_PAGE_MULTIPLE = 256


@dataclass
class FlashAttentionPlan:
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32


class FlashAttention(AttentionBackend):
    name = "flash_attn"

    @staticmethod
    def block_size_for(requested: int) -> int:
        """The requested size when flash-attn can page with it, else the next multiple of 256."""
        return -(-requested // FLASH_PAGE_MULTIPLE) * FLASH_PAGE_MULTIPLE

    def plan(self, inputs: AttentionInputs) -> FlashAttentionPlan:
        cu_k = torch.zeros(inputs.num_reqs + 1, dtype=torch.int32, device=inputs.seq_lens.device)
        torch.cumsum(inputs.seq_lens, dim=0, dtype=torch.int32, out=cu_k[1:])
        return FlashAttentionPlan(
            slot_mapping=inputs.slot_mapping,
            cu_seqlens_q=inputs.query_start_loc,
            cu_seqlens_k=cu_k,
            max_seqlen_q=inputs.max_query_len,
            max_seqlen_k=inputs.max_seq_len,
            block_table=inputs.block_table.contiguous(),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, plan: FlashAttentionPlan
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, plan.slot_mapping)
        k_cache, v_cache = kv_cache
        out = flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=plan.block_table,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
