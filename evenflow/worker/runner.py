"""ModelRunner: SchedulerOutput -> persistent batch -> varlen inputs -> forward -> sample.

The worker process (evenflow/worker/process.py) drives one ModelRunner per rank:

    runner = ModelRunner(config)
    runner.init_kv_cache(runner.determine_num_kv_blocks())   # min over ranks, decided by the engine
    out = runner.execute_model(scheduler_output)              # every step, on every rank

With tensor parallelism every rank runs the same steps; rank 0 samples and broadcasts the sampled
ids so every rank appends the same tokens (see evenflow/worker/parallel.py), and only rank 0 returns a
ModelRunnerOutput.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from evenflow.protocol import ModelRunnerOutput, SchedulerOutput, TokenLogprobs, WorkerConfig
from evenflow.worker.attention.selector import select_backend
from evenflow.worker.batch import PersistentBatch, RequestState, StepInputs
from evenflow.worker.config_reader import read_model_config
from evenflow.worker.device_timer import ForwardTimer
from evenflow.worker.grammar_mask import apply_grammar_bitmask
from evenflow.worker.layered_prefill import LayeredForward, LayeredHiddenStore, without_last_request
from evenflow.worker.kv_cache import (
    allocate_kv_cache, blocks_usable, bytes_per_block, cpu_kv_cache_size, cuda_kv_cache_size, measure_cuda_memory,
)
from evenflow.worker.int4_weights import effective_quantization
from evenflow.worker.loader import load_weights, resolve_dtype
from evenflow.worker.lora.pool import build_lora_pool
from evenflow.worker.models.compiled_ops import COMPILE_MIN_ROWS, compile_layer_ops
from evenflow.worker.models.fused_decode import attach_fused_decode
from evenflow.worker.models.layer_glue import attach_layer_glue
from evenflow.worker.models.registry import build_model
from evenflow.worker.parallel import destroy_tensor_parallel, init_tensor_parallel
from evenflow.worker.prompt_logprobs import PromptLogprobsTracker, logits_rows, split_prompt_logits
from evenflow.worker.sampler import Sampler
from evenflow.worker.sampling_metadata import SamplingMetadata, all_plain_greedy
from evenflow.worker.spec_decode import GeneratorRewind, NgramDrafter, accept_drafts, emitted_rows
from evenflow.worker.synthetic_steps import SyntheticStep, heaviest_sampling, synthetic_step, warmup_shapes
from evenflow.worker.threads import ThreadSetter, plan_step_threads, process_run_queue_wait, step_flops

log = logging.getLogger("evenflow.worker.runner")


def resolve_device(requested: str, rank: int, world_size: int = 1) -> torch.device:
    """``auto``: this rank's CUDA device when there is one, else the CPU.

    Ranks never share a GPU: two ranks on one device would split its memory and serialize their
    kernels, which is slower than one rank, so that is refused with what to change.
    """
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    visible = torch.cuda.device_count()
    if device.index is not None and world_size > 1:
        raise ValueError(f"--device {requested} pins all {world_size} tensor-parallel ranks to one GPU; "
                         f"use --device cuda (rank i runs on GPU i)")
    if world_size > visible:
        raise ValueError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs, one per rank, but "
                         f"{visible} {'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): lower --tensor-parallel-size "
                         f"or make more GPUs visible")
    return device if device.index is not None else torch.device("cuda", rank)


class ModelRunner:
    """Loads the model for one rank and executes scheduler steps on it."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device, config.rank, config.world_size)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.tp = init_tensor_parallel(config.rank, config.world_size, config.dist_init_addr, self.device)
        self.model_config = read_model_config(config.model)
        self.torch_dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.device)
        self.dtype = str(self.torch_dtype).removeprefix("torch.")
        backend_cls = select_backend(config.attention_backend, self.device, self.torch_dtype)
        self.attention_backend = backend_cls.name
        self.block_size = backend_cls.block_size_for(config.block_size)
        if self.block_size != config.block_size:  # coarser blocks also coarsen prefix-cache sharing
            log.warning("the %s attention backend pages KV in blocks of %d tokens: block size %d -> %d",
                        self.attention_backend, self.block_size, config.block_size, self.block_size)
        torch.manual_seed(config.seed)
        self.model = build_model(self.model_config, self.tp, self.torch_dtype, self.device, config.max_model_len)
        self.num_params = sum(p.numel() for p in self.model.parameters())  # this rank's shard
        self.threads = ThreadSetter(plan_step_threads(self.device, config.world_size, config.num_threads),
                                    self.num_params * torch.empty(0, dtype=self.torch_dtype).element_size(),
                                    process_run_queue_wait)
        load_weights(self.model, config.model, config.load_format, config.seed,
                     effective_quantization(config.quantization, config.dtype))
        self.model.eval()
        if self.device.type == "cpu" and not config.enforce_eager and config.max_num_batched_tokens >= COMPILE_MIN_ROWS:
            counts = self.threads.plan.counts if self.threads.plan is not None else ()
            log.info("layer elementwise ops: %s", compile_layer_ops(self.model, COMPILE_MIN_ROWS, counts))
        if self.device.type == "cpu":
            log.info("layer elementwise ops of the other steps: %s", attach_layer_glue(self.model))
        cfg = self.model_config
        self.attn = backend_cls(self.model.num_heads, self.model.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5,
                                self.kv_dtype, self.device)
        if self.device.type == "cpu":
            log.info("layers of few-row decode steps: %s", attach_fused_decode(self.model, self.attn))
        self.batch = PersistentBatch(config.max_num_seqs, config.max_model_len, self.block_size, self.device,
                                     cfg.num_layers)
        self.layered_hidden = LayeredHiddenStore()  # prompts between their layer-group steps
        self.sampler = Sampler()
        self.forward_timer = ForwardTimer(self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.vocab_size = cfg.vocab_size
        spec = config.speculative_config
        self.drafter = NgramDrafter(spec, config.max_model_len) if spec is not None else None
        self.lora = build_lora_pool(config.lora_config, self.model, self.tp, self.torch_dtype, self.device)
        self.prompt_logprobs = PromptLogprobsTracker()

    # ------------------------------------------------------------------ KV cache

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's choice (``LlamaModel.kv_dtype``)."""
        return self.model.kv_dtype

    def _block_bytes(self) -> int:
        return bytes_per_block(self.model_config.num_layers, self.block_size, self.model.num_kv_heads,
                               self.model_config.head_dim, self.kv_dtype)

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank can hold: ``num_kv_blocks`` if set, else from memory and what the
        scheduler can use (see kv_cache.py); the log says which."""
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        lookahead = c.speculative_config.num_speculative_tokens if c.speculative_config is not None else 0
        usable = blocks_usable(c.max_model_len, c.max_num_seqs, self.block_size, lookahead)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak of this profile, not of loading
            self.profile_forward()
            size = cuda_kv_cache_size(self._block_bytes(), measure_cuda_memory(self.device), c.kv_cache_memory, usable)
        else:
            size = cpu_kv_cache_size(self._block_bytes(), c.kv_cache_memory, c.world_size, usable)
        log.info("KV cache of rank %d: %d blocks of %d tokens (%.2f GiB, %s): %s", c.rank, size.num_blocks,
                 self.block_size, size.num_blocks * self._block_bytes() / 2**30, str(self.kv_dtype)[6:], size.reason)
        return size.num_blocks

    def profile_forward(self) -> None:
        """The largest step (``max_step_rows`` or max_num_batched_tokens rows, max_num_seqs samples) on a
        scratch cache, then the sampler's costliest path on its logits, so that the activation and sampling
        memory is measured before the real cache is sized."""
        tokens = min(self.config.max_step_rows or self.config.max_num_batched_tokens, self.config.max_model_len)
        step = synthetic_step([tokens], [tokens], self.block_size, self.device)
        num_samples = min(self.config.max_num_seqs, tokens)
        step.logits_indices = torch.arange(tokens - num_samples, tokens, device=self.device)
        caches = self._scratch_caches(step.num_blocks)
        with torch.inference_mode():
            logits = self._run_synthetic(step, caches)
            logits.zero_()  # a flat distribution: top-p sorts the whole vocabulary
            self.sampler(logits, heaviest_sampling(num_samples, self.vocab_size, self.eos_token_ids, self.device))
        del caches, logits

    def warm_up(self) -> None:
        """Run every step shape class once (see synthetic_steps.warmup_shapes), so that no kernel
        compiles (Triton) or initializes (cuBLAS, the sampler's) while requests wait."""
        c = self.config
        for q_lens, ctx_lens in warmup_shapes(c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len,
                                              self.block_size):
            step = synthetic_step(q_lens, ctx_lens, self.block_size, self.device)
            # The real cache's first blocks when it has them (no request holds a block yet, and they
            # are zeroed again below), so the warm-up needs no memory beyond what was sized.
            borrowed = bool(self.kv_caches) and step.num_blocks <= self.kv_caches[0][0].shape[0]
            caches = self.kv_caches if borrowed else self._scratch_caches(step.num_blocks)
            with torch.inference_mode():
                logits = self._run_synthetic(step, caches)
                self.sampler(logits, heaviest_sampling(len(q_lens), self.vocab_size, self.eos_token_ids, self.device))
                self.sampler(logits, SamplingMetadata(num_reqs=len(q_lens), vocab_size=self.vocab_size))  # greedy
                if borrowed:
                    for k_cache, v_cache in caches:
                        k_cache[: step.num_blocks].zero_()
                        v_cache[: step.num_blocks].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _scratch_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return allocate_kv_cache(self.model_config.num_layers, num_blocks, self.block_size, self.model.num_kv_heads,
                                 self.model_config.head_dim, self.kv_dtype, self.device)

    def _run_synthetic(self, step: SyntheticStep, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, caches, self.attn, self.attn.plan(step.attn),
                          step.logits_indices)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer (K and V)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.kv_caches = allocate_kv_cache(self.model_config.num_layers, num_blocks, self.block_size,
                                           self.model.num_kv_heads, self.model_config.head_dim, self.kv_dtype,
                                           self.device)
        if self.device.type == "cuda":
            self.warm_up()

    # ------------------------------------------------------------------ steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on rank 0, None on the other ranks."""
        if not self.kv_caches:
            raise RuntimeError("execute_model before init_kv_cache")
        so = scheduler_output
        t0 = time.perf_counter()
        self.batch.update(so)
        if len(self.layered_hidden):
            self.layered_hidden.drop_uncontinued(so)
        idle = so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens
        self.prompt_logprobs.update(so)
        if self.lora is not None:
            self.lora.take_step_orders(so, wait=idle)  # an idle step holds nobody up: wait for the loads
        if idle:
            return self._lora_report(ModelRunnerOutput(so.step_id, [], [])) if self.tp.rank == 0 else None
        inputs = self.batch.prepare_inputs(so)
        lora = None if self.lora is None else self.lora.prepare_step(
            [s.lora for s in inputs.requests], np.diff(inputs.attn.query_start_loc_np))
        self.threads.before_step(*self._step_work(inputs))
        plan = self.attn.plan(inputs.attn)
        prompt_plan = self.prompt_logprobs.plan(inputs)  # its rows ride after the sampling rows
        layered = self._layered_forward(so, inputs)
        t1 = time.perf_counter()
        self.forward_timer.start()
        with torch.inference_mode():
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attn, plan,
                                logits_rows(inputs, prompt_plan), lora, self._argmax_only(so, inputs, prompt_plan),
                                layered)
        self.forward_timer.stop()
        if layered is not None and layered.hidden_out is not None:
            self.layered_hidden.keep(layered.rows.req_id, layered.hidden_out)
        logits, prompt_logprobs = split_prompt_logits(logits, inputs, prompt_plan, self.tp.rank == 0)
        sample_mask = inputs.sample_mask
        sampled_reqs = [s for s, m in zip(inputs.requests, sample_mask.tolist()) if m]
        num_drafts = inputs.num_drafts[sample_mask]
        rewind = GeneratorRewind.save(sampled_reqs, num_drafts) if num_drafts.any() else None
        # A request with d drafts samples d + 1 rows, all with its own parameters.
        row_reqs = [s for s, d in zip(sampled_reqs, num_drafts.tolist()) for _ in range(d + 1)]
        if so.structured_output_req_ids and self.tp.rank == 0:  # only rank 0 samples
            logits = apply_grammar_bitmask(logits, [s.req_id for s in row_reqs], so, self.vocab_size)
        targets, logprobs = self._sample(logits, row_reqs)  # the step's host synchronization
        num_emitted = None
        if rewind is not None:
            drafts = NgramDrafter.stored_drafts(self.batch, sampled_reqs, num_drafts)
            num_emitted = accept_drafts(targets, drafts, num_drafts)
            rewind.replay(num_emitted, self.vocab_size, self.device)
            kept = emitted_rows(num_drafts, num_emitted)
            targets = targets[kept]
            logprobs = [logprobs[i] for i in kept.tolist()] if logprobs is not None else None
        self.batch.append_sampled(sampled_reqs, targets, num_emitted)
        proposals = self.drafter.propose(self.batch, sampled_reqs) if self.drafter is not None else None
        t3 = time.perf_counter()
        forward_s = self.forward_timer.seconds()  # device time on CUDA, read after the sync
        self.threads.after_step(forward_s)
        if self.tp.rank != 0:
            return None
        out = self._output(so.step_id, inputs, targets, num_emitted, logprobs, proposals, t1 - t0, forward_s,
                           max(t3 - t1 - forward_s, 0.0))
        out.prompt_logprobs = prompt_logprobs
        out.contended = self.threads.contended
        out.threads_fallback = self.threads.in_fallback
        return self._lora_report(out)

    def _layered_forward(self, so: SchedulerOutput, inputs: StepInputs) -> LayeredForward | None:
        """The forward's view of a prompt prefilled by layer groups: its span, its stream so far, and
        the attention plan of the step without it."""
        rows = inputs.layered
        if rows is None:
            return None
        if self.lora is not None or self.tp.enabled or self.prompt_logprobs.wants(rows.req_id):
            raise ValueError(f"step {so.step_id}: a layered prefill of {rows.req_id!r} beside LoRA, tensor "
                             f"parallelism or prompt logprobs, which this worker does not split by layer")
        rest = self.attn.plan(without_last_request(inputs.attn, rows.num_rows))
        return LayeredForward(rows, rest, self.layered_hidden.take(rows, so.step_id))

    def _lora_report(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """Fill the adapter loads, failures and evictions since the previous output."""
        if self.lora is not None:
            loaded, failed, evicted = self.lora.host.take_report()
            out.lora_loaded, out.lora_evicted = loaded, evicted
            out.lora_failed = [identity for identity, _ in failed]
            out.lora_failed_reasons = [reason for _, reason in failed]
        return out

    def _step_work(self, inputs: StepInputs) -> tuple[float, int]:
        """The step's estimated FLOPs and its tokens, a layered prefill's rows counted by their share of
        the layers (the thread rule compares steps' time per FLOP; evenflow/worker/threads.py)."""
        a = inputs.attn
        pairs = np.diff(a.query_start_loc_np) * a.seq_lens_np
        tokens = float(a.num_tokens)
        layered = inputs.layered
        if layered is not None:
            share = (layered.end - layered.start) / self.model_config.num_layers
            tokens -= layered.num_rows * (1 - share)
            pairs = pairs.astype(np.float64)
            pairs[-1] *= share
        flops = step_flops(self.num_params, tokens, float(pairs.sum()), self.model_config.num_layers,
                           self.model.num_heads, self.model_config.head_dim)
        return flops, max(int(tokens), 1)

    @staticmethod
    def _argmax_only(so: SchedulerOutput, inputs: StepInputs, prompt_plan: object) -> bool:
        """Whether the step reads nothing of its logits but each row's argmax (the LM head may then
        leave the rest rough): every request plain greedy, no grammar mask, no prompt logprobs."""
        return (prompt_plan is None and not so.structured_output_req_ids
                and all_plain_greedy(s.sampling for s in inputs.requests))

    def _sample(self, logits: torch.Tensor, reqs: list[RequestState]) -> tuple[np.ndarray, list | None]:
        """Rank 0 samples; other ranks receive its ids. Returns (ids as numpy, sampler logprobs)."""
        if not reqs:
            return np.zeros(0, dtype=np.int64), None
        logprobs = None
        if self.tp.rank == 0:
            meta = SamplingMetadata.build([s.sampling for s in reqs], self.vocab_size, self.eos_token_ids,
                                          self.device)
            with torch.inference_mode():  # the logits are inference tensors
                out = self.sampler(logits, meta)
            ids, logprobs = out.sampled_token_ids, out.logprobs
        else:
            ids = torch.empty(len(reqs), dtype=torch.long, device=self.device)
        ids = self.tp.broadcast_from_rank0(ids)
        return ids.cpu().numpy(), logprobs

    def _output(self, step_id: int, inputs: StepInputs, sampled: np.ndarray, num_emitted: np.ndarray | None,
                logprobs: list | None, proposals: np.ndarray | None, prepare_s: float, forward_s: float,
                sample_s: float) -> ModelRunnerOutput:
        """Per request (aligned with ``inputs.requests``): its emitted tokens, their logprobs, and
        with speculation on the drafts it verified and the ones it proposed for the next step."""
        mask = inputs.sample_mask
        counts = np.zeros(len(mask), dtype=np.int64)
        counts[mask] = 1 if num_emitted is None else num_emitted
        ends = np.cumsum(counts).tolist()
        tokens = sampled.tolist()
        spans = list(zip([0, *ends[:-1]], ends))
        sampled_lists = [tokens[a:b] for a, b in spans]
        aligned: list[list[TokenLogprobs] | None] | None = None
        if logprobs is not None:
            aligned = [logprobs[a:b] if b > a and logprobs[a] is not None else None for a, b in spans]
        num_proposed = num_draft_tokens = None
        if proposals is not None:
            proposed = np.zeros(len(mask), dtype=np.int64)
            proposed[mask] = proposals
            num_proposed = proposed.tolist()
            num_draft_tokens = inputs.num_drafts.tolist()
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=[s.req_id for s in inputs.requests],
            sampled_token_ids=sampled_lists,
            logprobs=aligned,
            num_proposed_drafts=num_proposed,
            prepare_s=prepare_s,
            forward_s=forward_s,
            sample_s=sample_s,
            num_draft_tokens=num_draft_tokens,
        )

    def shutdown(self) -> None:
        """Release the cache and leave the process group."""
        self.kv_caches = []
        if self.lora is not None:
            self.lora.host.shutdown()
        destroy_tensor_parallel()
