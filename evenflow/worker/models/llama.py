"""The Llama-family decoder: Llama, Mistral (full attention), Qwen2 (qkv bias), Qwen3 (q/k norm).

One implementation covers all four: they differ only in the optional qkv bias and per-head q/k
RMSNorm. Projections are fused (qkv, gate_up) and sharded for tensor parallelism; the loader
(evenflow/worker/loader.py) fills the fused, sharded parameters from HuggingFace tensor names through
``weight_specs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from evenflow.worker.attention.base import AttentionBackend, KVCache
from evenflow.worker.config_reader import ModelConfig
from evenflow.worker.lora.pool import LoRAStep
from evenflow.worker.models.layers import RotaryTable, apply_rotary, rms_norm, rms_norm_heads
from evenflow.worker.models.linear import pick_linear
from evenflow.worker.parallel import TensorParallel
from torch import nn


@dataclass(frozen=True)
class WeightSpec:
    """Where one HuggingFace tensor goes: a parameter, which dim is sharded, at which row offset."""

    param: str
    shard_dim: int | None  # None: replicated; 0: rows (column-parallel); 1: columns (row-parallel)
    row_offset: int = 0  # for fused parameters: the first row this tensor's shard fills


@dataclass
class LayerLinears:
    """One layer's projection weights as the linear kernel wants them (see models/linear.py)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Holds one layer's weights; the forward lives in ``LlamaModel`` to keep calls flat."""

    def __init__(self, cfg: ModelConfig, heads: int, kv_heads: int, inter: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv = _param((heads + 2 * kv_heads) * d, h, dtype=dtype, device=device)
        self.qkv_bias = _param((heads + 2 * kv_heads) * d, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.q_norm = _param(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o = _param(h, heads * d, dtype=dtype, device=device)
        self.post_norm = _param(h, dtype=dtype, device=device)
        self.gate_up = _param(2 * inter, h, dtype=dtype, device=device)
        self.down = _param(h, inter, dtype=dtype, device=device)


class LlamaModel(nn.Module):
    """Decoder-only transformer over flat varlen token batches and a paged KV cache."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        super().__init__()
        if cfg.sliding_window is not None and cfg.sliding_window < max_model_len:
            raise ValueError(
                f"{cfg.architecture} uses a sliding window of {cfg.sliding_window} tokens, shorter than "
                f"max_model_len={max_model_len}; this engine computes full attention only. "
                f"Set max_model_len <= {cfg.sliding_window}."
            )
        if cfg.num_heads % tp.world_size or cfg.num_kv_heads % tp.world_size:
            raise ValueError(
                f"tensor_parallel_size={tp.world_size} must divide num_attention_heads={cfg.num_heads} "
                f"and num_key_value_heads={cfg.num_kv_heads}"
            )
        self.cfg, self.tp, self.dtype, self.device = cfg, tp, dtype, device
        self.num_heads = cfg.num_heads // tp.world_size
        self.num_kv_heads = cfg.num_kv_heads // tp.world_size
        self.intermediate = cfg.intermediate_size // tp.world_size
        if cfg.intermediate_size % tp.world_size:
            raise ValueError(f"tensor_parallel_size={tp.world_size} must divide intermediate_size")
        # The vocabulary is padded to a multiple of the TP size so every rank holds equal rows.
        self.padded_vocab = -(-cfg.vocab_size // tp.world_size) * tp.world_size
        self.vocab_start, self.vocab_end = tp.shard_range(self.padded_vocab)
        local_vocab = self.vocab_end - self.vocab_start
        self.embed = _param(local_vocab, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.num_heads, self.num_kv_heads, self.intermediate, dtype, device)
            for _ in range(cfg.num_layers)
        )
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = None if cfg.tie_word_embeddings else _param(local_vocab, cfg.hidden_size, dtype=dtype,
                                                                   device=device)
        self.rotary = RotaryTable(cfg.head_dim, max(max_model_len, 1), cfg.rope_theta, cfg.rope_scaling, dtype,
                                  device)
        self.linear = pick_linear(dtype, device)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # Qwen3: one weight row per head over the q and k heads together, so one norm call per layer.
        self._qk_norm_weights: list[torch.Tensor] = []
        # Filled by finish_loading: the weights in the linear kernel's own layout.
        self._linears: list[LayerLinears] = []
        self._head: torch.Tensor | None = None

    # ---------------------------------------------------------------- loading

    def weight_specs(self) -> dict[str, WeightSpec]:
        """HuggingFace tensor name -> where it goes, for every tensor this model needs."""
        cfg = self.cfg
        specs: dict[str, WeightSpec] = {
            "model.embed_tokens.weight": WeightSpec("embed", 0),
            "model.norm.weight": WeightSpec("norm", None),
        }
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head", 0)
        q, kv, inter = self.q_size, self.kv_size, self.intermediate
        for i in range(cfg.num_layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            specs[p + "input_layernorm.weight"] = WeightSpec(f"layers.{i}.input_norm", None)
            specs[p + "post_attention_layernorm.weight"] = WeightSpec(f"layers.{i}.post_norm", None)
            for name, offset in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
                specs[a + name + ".weight"] = WeightSpec(f"layers.{i}.qkv", 0, offset)
                if cfg.qkv_bias:
                    specs[a + name + ".bias"] = WeightSpec(f"layers.{i}.qkv_bias", 0, offset)
            if cfg.qk_norm:
                specs[a + "q_norm.weight"] = WeightSpec(f"layers.{i}.q_norm", None)
                specs[a + "k_norm.weight"] = WeightSpec(f"layers.{i}.k_norm", None)
            specs[a + "o_proj.weight"] = WeightSpec(f"layers.{i}.o", 1)
            specs[m + "gate_proj.weight"] = WeightSpec(f"layers.{i}.gate_up", 0, 0)
            specs[m + "up_proj.weight"] = WeightSpec(f"layers.{i}.gate_up", 0, inter)
            specs[m + "down_proj.weight"] = WeightSpec(f"layers.{i}.down", 1)
        return specs

    def finish_loading(self) -> None:
        """Derive helper tensors once the weights are in place (zero the padded vocab rows)."""
        pad_from = self.cfg.vocab_size - self.vocab_start
        with torch.no_grad():
            if pad_from < self.embed.shape[0]:
                self.embed[max(pad_from, 0):].zero_()
                if self.lm_head is not None:
                    self.lm_head[max(pad_from, 0):].zero_()
        if self.cfg.qk_norm:
            self._qk_norm_weights = [
                torch.cat([layer.q_norm.expand(self.num_heads, -1), layer.k_norm.expand(self.num_kv_heads, -1)])
                for layer in self.layers
            ]
        self._prepare_linears()

    def _prepare_linears(self) -> None:
        """Hand every projection weight to the linear kernel once. A kernel that re-lays a weight
        out (oneDNN packing) gets a copy, and the loaded tensor is released so memory does not
        double; the tied embedding stays, since the embedding lookup reads it."""
        prepare = self.linear.prepare

        def take(param: nn.Parameter) -> torch.Tensor:
            prepared = prepare(param)
            if prepared is not param:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            return prepared

        self._linears = [
            LayerLinears(take(layer.qkv), layer.qkv_bias, take(layer.o), take(layer.gate_up), take(layer.down))
            for layer in self.layers
        ]
        self._head = prepare(self.embed) if self.lm_head is None else take(self.lm_head)

    # ---------------------------------------------------------------- forward

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: AttentionBackend,
        attn_plan: object,
        logits_indices: torch.Tensor,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Run every layer over the step's tokens; return float32 logits [len(logits_indices), vocab].

        ``lora`` adds the step's LoRA adapters to the projections they target (evenflow/worker/lora/pool.py).
        """
        cfg = self.cfg
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        n = input_ids.shape[0]
        cos, sin = self.rotary.lookup(positions)
        x = self.embed_tokens(input_ids)
        qk_heads = self.num_heads + self.num_kv_heads
        linear = self.linear
        for i, (layer, w) in enumerate(zip(self.layers, self._linears)):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = linear(h, w.qkv, w.qkv_bias)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            qk = qkv[:, : self.q_size + self.kv_size].view(n, qk_heads, d)
            if cfg.qk_norm:
                qk = rms_norm_heads(qk, self._qk_norm_weights[i], eps)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, d)
            o = attn.forward(q, k, v, kv_caches[i], attn_plan)
            o_out = linear(o, w.o, None)
            if lora is not None:  # row-parallel: each rank's partial delta joins the all-reduce
                lora.add(i, "o", o, o_out)
            x = x + self.tp.all_reduce(o_out)
            h = rms_norm(x, layer.post_norm, eps)
            gu = linear(h, w.gate_up, None)
            if lora is not None:
                lora.add(i, "gate_up", h, gu)
            act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :]
            down = linear(act, w.down, None)
            if lora is not None:
                lora.add(i, "down", act, down)
            x = x + self.tp.all_reduce(down)
        x = rms_norm(x.index_select(0, logits_indices), self.norm, eps)
        logits = self.tp.all_gather_last_dim(linear(x, self._head, None).float())
        return logits[:, : cfg.vocab_size]
