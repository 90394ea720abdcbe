"""The Llama-family decoder: Llama, Mistral (full attention), Qwen2 (qkv bias), Qwen3 (q/k norm).

One implementation covers all four: they differ only in the optional qkv bias and per-head q/k
RMSNorm. Projections are fused (qkv, gate_up) and sharded for tensor parallelism; the loader
(evenflow/worker/loader.py) fills the fused, sharded parameters from HuggingFace tensor names through
``weight_specs``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from evenflow.worker.attention.base import AttentionBackend, KVCache
from evenflow.worker.config_reader import ModelConfig
from evenflow.worker.layered_prefill import LayeredForward, layered_boundary
from evenflow.worker.lora.pool import LoRAStep
from evenflow.worker.models.compiled_ops import CompiledOps, swiglu
from evenflow.worker.models.int4_linear import Int4CpuLinear, Int4Plan, int4_fits, int4_plan, layout_matches
from evenflow.worker.models.layer_glue import LayerGlue
from evenflow.worker.models.layers import RotaryTable, apply_rotary, rms_norm, rms_norm_heads, rms_norm_narrowing
from evenflow.worker.models.lm_head import ScreenedHead
from evenflow.worker.models.linear import (
    UpcastCpuLinear, cpu_has_fast_path, emulated_slowdown, pick_linear,
)
from evenflow.worker.models.q4_blocks import Int4Weight, Q4Rows, concat_rows, pack
from evenflow.worker.models.weight_specs import WeightSpec, llama_weight_specs
from evenflow.worker.parallel import TensorParallel
from torch import nn

if TYPE_CHECKING:
    from evenflow.worker.models.fused_decode import FusedDecode

log = logging.getLogger("evenflow.worker.llama")


@dataclass
class LayerLinears:
    """One layer's projection weights as the linear kernel wants them (see models/linear.py)."""

    qkv: torch.Tensor | Int4Weight
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | Int4Weight
    gate_up: torch.Tensor | Int4Weight
    down: torch.Tensor | Int4Weight


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
        # The LM head's kernel: the dense one, or beside int4 projections a screened head
        # (models/lm_head.py): a bfloat16 screen where the CPU has native bf16, else a float16 one, whose
        # leading logits are recomputed in float32, and a 4-bit screen on plain greedy steps. A plain
        # bfloat16 head rounds logits to 0.125 at 25 and ties real top-2 choices (SmolLM2 answered
        # "L'Etoile" to "What is the capital of France?" where float32 says "The capital of France is Paris.").
        self.head_linear = self.linear
        self._screened_head: ScreenedHead | None = None
        if isinstance(self.linear, UpcastCpuLinear):
            slow = emulated_slowdown(dtype, (2 * self.intermediate, cfg.hidden_size))
            log.warning("--dtype %s on a CPU without native %s (no avx512_bf16/amx_bf16): a projection takes "
                        "%.1fx float32's time at 1 row, %.1fx at 64 rows (measured); --dtype float32 is faster here",
                        str(dtype)[6:], str(dtype)[6:], *slow)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # Qwen3: one weight row per head over the q and k heads together, so one norm call per layer.
        self._qk_norm_weights: list[torch.Tensor] = []
        # Per layer (input norm, post norm) weights * sqrt(hidden), for rms_norm_narrowing.
        self._scaled_norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._eps_root = torch.tensor(math.sqrt(cfg.hidden_size * cfg.rms_norm_eps))
        # Filled by finish_loading: the weights in the linear kernel's own layout.
        self._linears: list[LayerLinears] = []
        self._head: torch.Tensor | None = None
        # 4-bit rows the loader kept (param name -> row offset -> rows), packed by finish_loading.
        self._int4_parts: dict[str, dict[int, Q4Rows]] = {}
        self.int4_required = False  # --quantization gguf: 4-bit even where the measurement says it is slower
        # The KV cache's dtype (set by finish_loading): the model's, or bfloat16 beside int4 projections
        # on a CPU with native bf16, where V comes out of the int4 kernel in bfloat16 already and a
        # bfloat16 cache halves the K/V bytes every decode reads (SDPA 67 against 80 us a layer at
        # 8 x 130 tokens, 121 against 196 at 8 x 250, on a 2-core Xeon with AMX: probe_kernel_choices.py).
        self.kv_dtype = dtype
        self.int4_plan: Int4Plan | None = None  # the start-up measurement's choice, where 4-bit parts were loaded
        self.compiled_ops: CompiledOps | None = None  # set by the runner where many-row steps compile
        self.layer_glue: LayerGlue | None = None  # set by the runner where the narrowing path runs
        self.fused_decode: FusedDecode | None = None  # set by the runner beside the glue and the decode kernel

    # ---------------------------------------------------------------- loading

    def weight_specs(self) -> dict[str, WeightSpec]:
        """HuggingFace tensor name -> where it goes, for every tensor this model needs."""
        return llama_weight_specs(self.cfg, self.q_size, self.kv_size, self.intermediate)

    def int4_params(self) -> set[str]:
        """The projection parameters that may be kept 4-bit (not sharded: blocks span whole rows only)."""
        if self.tp.enabled or self.device.type != "cpu":
            return set()
        return {f"layers.{i}.{name}" for i in range(self.cfg.num_layers) for name in ("qkv", "o", "gate_up", "down")}

    def int4_param_names(self) -> list[str]:
        """The projections held 4-bit after loading (for the log and the benchmarks)."""
        return [f"layers.{i}.{name}" for i, w in enumerate(self._linears)
                for name in ("qkv", "o", "gate_up", "down") if isinstance(getattr(w, name), Int4Weight)]

    def load_int4_part(self, param: str, row_offset: int, rows: Q4Rows) -> None:
        """Keep ``rows`` of ``param`` (from ``row_offset``) 4-bit instead of copying dense values in."""
        self._int4_parts.setdefault(param, {})[row_offset] = rows

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
        root = math.sqrt(self.cfg.hidden_size)
        self._scaled_norms = [(layer.input_norm * root, layer.post_norm * root) for layer in self.layers]
        self._prepare_linears()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, scaled: torch.Tensor, out_dtype: torch.dtype
              ) -> torch.Tensor:
        """RMSNorm into the next projection's dtype: a narrowing one (int4's bfloat16 from the float32
        stream) takes the shorter form; the rest, the float32 reference path among them, F.rms_norm."""
        if x.dtype == torch.float32 and out_dtype != torch.float32:
            return rms_norm_narrowing(x, scaled, self._eps_root, out_dtype)
        return rms_norm(x, weight, self.cfg.rms_norm_eps, out_dtype)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, scaled: torch.Tensor,
                  out_dtype: torch.dtype, ops: CompiledOps | LayerGlue | None) -> torch.Tensor:
        """``x += delta`` (the residual stream, this step's own tensor; all-reduced across ranks), then
        its RMSNorm into ``out_dtype``: one compiled graph or C++ call where the step takes ``ops``."""
        if delta is None:
            return self._norm(x, weight, scaled, out_dtype)
        if ops is not None:  # never with tensor parallelism (the narrowing path is int4's)
            return ops.add_norm(x, delta, scaled, self._eps_root)
        x.add_(self.tp.all_reduce(delta))
        return self._norm(x, weight, scaled, out_dtype)

    def _prepare_linears(self) -> None:
        """Hand every projection weight to the linear kernel once. A kernel that re-lays a weight
        out (oneDNN packing, int4 packing) gets a copy, and the loaded tensor is released so memory
        does not double; the tied embedding stays, since the embedding lookup reads it."""
        if self._int4_parts:
            # The plan is measured on the widest projection kept 4-bit, the one that costs a step most.
            int4 = [p for n, p in self.named_parameters() if n in self._int4_parts]
            shape = max((tuple(p.shape) for p in int4), key=lambda s: s[0] * s[1])
            self.int4_plan = plan = int4_plan(shape, cpu_has_fast_path(torch.bfloat16), sum(p.numel() for p in int4))
            if self.int4_required and not layout_matches():
                raise ValueError(f"--quantization gguf keeps 4-bit weights, which this machine cannot: {plan.reason}")
            if plan.max_int4_rows == 0 and not self.int4_required:
                log.warning("4-bit weights dequantized to %s: %s", self.dtype, plan.reason)
                self._dense_from_int4_parts()
            else:
                self.linear = Int4CpuLinear(self.linear, plan)
        prepare = self.linear.prepare

        def take(param: nn.Parameter, name: str) -> torch.Tensor | Int4Weight:
            parts = self._int4_parts.pop(name, None)
            if name == "lm_head":
                prepared = self.head_linear.prepare(param)
            else:
                prepared = prepare(param) if parts is None else self._pack_int4(name, param, parts)
            if prepared is not param:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            return prepared

        def layer_linears(i: int, layer: DecoderLayer) -> LayerLinears:
            p = f"layers.{i}."
            return LayerLinears(take(layer.qkv, p + "qkv"), layer.qkv_bias, take(layer.o, p + "o"),
                                take(layer.gate_up, p + "gate_up"), take(layer.down, p + "down"))

        self._linears = [layer_linears(i, layer) for i, layer in enumerate(self.layers)]
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(self.linear, Int4CpuLinear) and self.dtype == torch.float32:
            bf16_fast = cpu_has_fast_path(torch.bfloat16)
            # The KV cache in bfloat16 wherever decode steps' projections take bfloat16 (the int4 kernel's
            # activations): half the bytes decode attention reads, and the C++ layer glue, decode attention and
            # fused layer loop (all bfloat16) run. Without native bfloat16 (AVX2) its conversions are shifts:
            # a one-row step of the real GGUF took 0.45x its time with a float32 cache, a 2048-token prompt
            # ~1.05x (docs/results/quantization.md, "AVX2").
            self.kv_dtype = torch.bfloat16 if bf16_fast or self.int4_plan.max_int4_rows > 0 else self.dtype
            # reads the float32 table as loaded
            self._screened_head = ScreenedHead.for_cpu(head.detach(), bf16_fast, self.head_linear,
                                                       self.int4_plan.max_int4_rows)
        if self._screened_head is not None:
            self._head = None
            screened = self._screened_head
            kind = "float32" if screened.exact else f"{screened.kind} screen, each row's top logits in float32"
            log.info("LM head: %s; plain greedy steps of up to %d rows a 4-bit screen", kind, screened.int4_rows)
        else:
            self._head = self.head_linear.prepare(head) if self.lm_head is None else take(head, "lm_head")
        if self._int4_parts:
            raise ValueError(f"4-bit rows for parameters without a slot: {sorted(self._int4_parts)}")

    def _pack_int4(self, name: str, param: nn.Parameter, parts: dict[int, Q4Rows]) -> torch.Tensor | Int4Weight:
        """One fused int4 weight from the 4-bit rows of every part (q, k, v; gate, up), or the dense
        weight when some part was stored in another type (mixed GGUFs such as Q4_K_M) or the rows do not
        fill the kernel's tiles."""
        filled = sum(r.rows for r in parts.values())
        if filled != param.shape[0] or not int4_fits(*param.shape):
            log.info("%s stays %s: its 4-bit rows (%d of %d) do not make a whole int4 weight", name, self.dtype,
                     filled, param.shape[0])
            self._copy_dense(param, parts)
            return self.linear.prepare(param)
        assert isinstance(self.linear, Int4CpuLinear)  # 4-bit parts are kept only under its plan
        return self.linear.laid_out(pack(concat_rows([parts[o] for o in sorted(parts)])))

    def _dense_from_int4_parts(self) -> None:
        params = dict(self.named_parameters())
        for name, parts in self._int4_parts.items():
            self._copy_dense(params[name], parts)
        self._int4_parts = {}

    @staticmethod
    def _copy_dense(param: nn.Parameter, parts: dict[int, Q4Rows]) -> None:
        with torch.no_grad():
            for offset, rows in parts.items():
                param[offset : offset + rows.rows].copy_(rows.values())

    # ---------------------------------------------------------------- forward

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def _rows_view(self, x: torch.Tensor, cos_all: torch.Tensor, sin_all: torch.Tensor,
                   lora: LoRAStep | None) -> tuple[int, torch.Tensor, torch.Tensor, CompiledOps | LayerGlue | None]:
        """The rows running the next layers (the step's first ``n``): their rotary tables, and the fused
        elementwise groups where the narrowing path runs: compiled for many rows (models/compiled_ops.py),
        C++ for the rest (models/layer_glue.py)."""
        n = x.shape[0]
        cos, sin = (cos_all, sin_all) if n == cos_all.shape[0] else (cos_all[:n], sin_all[:n])
        ops: CompiledOps | LayerGlue | None = None
        if lora is None:
            if self.compiled_ops is not None and self.compiled_ops.takes(n):
                ops = self.compiled_ops
            elif self.layer_glue is not None and self.layer_glue.takes(self.linear, n):
                ops = self.layer_glue
        return n, cos, sin, ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: AttentionBackend,
        attn_plan: object,
        logits_indices: torch.Tensor,
        lora: LoRAStep | None = None,
        greedy: bool = False,
        layered: LayeredForward | None = None,
    ) -> torch.Tensor:
        """Run every layer over the step's tokens; return float32 logits [len(logits_indices), vocab].

        ``lora`` adds the step's LoRA adapters to the projections they target (evenflow/worker/lora/pool.py).
        ``greedy``: only each row's argmax is read, so the LM head may leave the other logits rough.
        ``layered``: the step's last rows run through layers [start, end) only (a prompt prefilled by
        layer groups, evenflow/worker/layered_prefill.py); their stream comes in ``hidden_in`` and, when
        ``end`` is not the last layer, goes out in ``hidden_out`` (they then have no logits row).
        """
        cfg = self.cfg
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        cos_all, sin_all = self.rotary.lookup(positions)
        num_rest = input_ids.shape[0] - (layered.num_rows if layered is not None else 0)
        # The layered rows join the step at their span's first layer: from the embedding at layer 0.
        x = self.embed_tokens(input_ids if layered is None or layered.start == 0 else input_ids[:num_rest])
        qk_heads = self.num_heads + self.num_kv_heads
        qk_end = self.q_size + self.kv_size
        linear, tp, dtype, kv_dtype = self.linear, self.tp, self.dtype, self.kv_dtype
        # Activations go into each projection in the dtype its kernel computes in (bfloat16 for int4),
        # written so by the op before it; outputs stay in that dtype and are widened by the op that reads
        # them (the residual add, the rotary multiply). LoRA's matmuls need the model's dtype.
        act = dtype if lora is not None else None
        plan = attn_plan if layered is None or layered.start == 0 else layered.rest_plan
        delta: torch.Tensor | None = None  # the last projection's output, added to x by the next norm
        n, cos, sin, ops = self._rows_view(x, cos_all, sin_all, lora)
        fused = self.fused_decode is not None and layered is None and self.fused_decode.takes(attn_plan, n, ops, linear)
        if fused:  # every layer in one C++ call (models/fused_decode.py); the loop below runs none
            h0 = self._norm(x, self.layers[0].input_norm, self._scaled_norms[0][0], torch.bfloat16)
            self.fused_decode(x, h0, cos, sin, kv_caches, attn_plan, attn.scale, linear)
        stack = () if fused else zip(self.layers, self._linears, self._scaled_norms)
        for i, (layer, w, (in_scaled, post_scaled)) in enumerate(stack):
            if layered is not None and i in (layered.start, layered.end) and (i > 0 or layered.start > 0):
                x, delta, plan = layered_boundary(i, x, delta, layered, attn_plan, num_rest)
                n, cos, sin, ops = self._rows_view(x, cos_all, sin_all, lora)  # the rows changed: only here
            if n == 0:  # the layered rows are the step and are outside their span here
                continue
            h = self._add_norm(x, delta, layer.input_norm, in_scaled, act or linear.act_dtype(w.qkv, n), ops)
            qkv = linear(h, w.qkv, w.qkv_bias)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            if ops is not None and not cfg.qk_norm:
                qk = ops.rotary_qk(qkv, cos, sin)
            else:
                qk = qkv[:, :qk_end].view(n, qk_heads, d)
                if cfg.qk_norm:
                    qk = rms_norm_heads(qk, self._qk_norm_weights[i], eps)
                qk = apply_rotary(qk, cos, sin)
                qk = qk if qk.dtype == kv_dtype else qk.to(kv_dtype)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_end:].view(n, self.num_kv_heads, d)
            o = attn.forward(q, k, v if v.dtype == kv_dtype else v.to(kv_dtype), kv_caches[i], plan)
            o_act = act or linear.act_dtype(w.o, n)
            o = o if o.dtype == o_act else o.to(o_act)
            delta = linear(o, w.o, None)
            if lora is not None:  # row-parallel: each rank's partial delta joins the all-reduce
                lora.add(i, "o", o, delta)
            h = self._add_norm(x, delta, layer.post_norm, post_scaled, act or linear.act_dtype(w.gate_up, n), ops)
            gu = linear(h, w.gate_up, None)
            if lora is not None:
                lora.add(i, "gate_up", h, gu)
            a = ops.swiglu(gu) if ops is not None else swiglu(gu, self.intermediate, act or linear.act_dtype(w.down, n))
            delta = linear(a, w.down, None)
            if lora is not None:
                lora.add(i, "down", a, delta)
        if delta is not None:
            x.add_(tp.all_reduce(delta))
        x = rms_norm(x.index_select(0, logits_indices), self.norm, eps)
        if self._screened_head is not None:  # never with tensor parallelism (int4 projections are off there)
            return self._screened_head(x, greedy)[:, : cfg.vocab_size]
        logits = self.tp.all_gather_last_dim(self.head_linear(x, self._head, None).float())
        return logits[:, : cfg.vocab_size]
