"""The engine-core <-> workers messages: ``WorkerReady`` / ``InitKVCache`` handshake, ``SchedulerOutput``
to every rank, ``ModelRunnerOutput`` (or ``WorkerError``) back from rank 0. Tagged msgpack arrays, as
in evenflow/protocol/messages.py; internal to one engine (evenflow/protocol/README.md, last section)."""

from __future__ import annotations

from msgspec import Struct

from evenflow.protocol.lora import AdapterRef, LoRAConfig
from evenflow.protocol.messages import PromptLogprobs, SamplingParams, TokenLogprobs
from evenflow.protocol.speculative import SpeculativeConfig


class NewRequestData(Struct, array_like=True):
    """A request the workers have not seen yet: sent once, with its whole prompt."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: these tokens' KV is already in block_ids
    lora: AdapterRef | None = None  # the LoRA adapter serving it (None: the base model)


class CachedRequestData(Struct, array_like=True):
    """A request the workers already hold: only what changed since the last step.

    When ``resumed_from_preemption`` is set, ``new_block_ids`` replaces the whole block table
    (the request's old blocks were freed) instead of extending it.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False


class SchedulerOutput(Struct, tag="sched", array_like=True):
    """One step: which requests run and how many of their tokens."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # The sum of num_scheduled_tokens: the rows the step's forward carries. With a layer group in the step
    # (layer_spans) this can exceed the token budget, which charges the group only its share of its rows.
    total_num_scheduled_tokens: int
    # Draft slots per request (counted in num_scheduled_tokens): the worker fills up to this many
    # with its own drafts (the engine-core never sees draft tokens).
    num_draft_slots: dict[str, int] = {}
    # Requests that finished or were aborted since the last step: workers drop their state.
    finished_req_ids: list[str] = []
    # Requests preempted this step: workers drop them from the running batch but keep their
    # tokens, since a preempted request comes back as a CachedRequestData resumed_from_preemption.
    preempted_req_ids: list[str] = []
    # Structured output: requests whose logits are masked this step (each samples this step), and
    # their allowed-token bitmasks: int32 little-endian rows in that order, ceil(vocab/32) words
    # each, bit j of word w allowing token 32*w + j (llguidance's and xgrammar's layout).
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # LoRA: adapters the workers should load into host memory now, off the step path (they report
    # back in ModelRunnerOutput.lora_loaded); identities of unloaded adapters they may drop.
    lora_prefetch: list[AdapterRef] = []
    lora_unloaded: list[str] = []
    # A prompt prefilled by layer groups beside decodes (evenflow/core/sched/layered_prefill.py):
    # request id -> the layers [start, end) its scheduled tokens run through this step. The same
    # tokens come in each of its group steps; it samples in the one that ends at the last layer.
    layer_spans: dict[str, tuple[int, int]] = {}


class ModelRunnerOutput(Struct, tag="mro", array_like=True):
    """Results of one step from rank 0, aligned with ``req_ids``.

    A request whose scheduled chunk did not reach the end of its known tokens (a partial prefill)
    gets an empty list in ``sampled_token_ids``.
    """

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, one TokenLogprobs per sampled token (speculation may emit several per step).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per request, how many drafts the worker proposed after this step (it keeps the tokens; with
    # overlap off the engine-core reserves that many slots next step). None: no speculation.
    num_proposed_drafts: list[int] | None = None
    # Worker-side timing of this step in seconds: input building, forward, sampling.
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    # Seconds rank 0 sat idle waiting for this step's SchedulerOutput after finishing the previous
    # step (filled by the worker process loop, not the model runner).
    wait_s: float = 0.0
    # Per request, how many drafts this step verified (<= its draft slots; None: no speculation).
    num_draft_tokens: list[int] | None = None
    # LoRA adapters (identities) rank 0 finished loading into host memory, failed to load (with
    # the reason, aligned), or evicted from it since its previous output.
    lora_loaded: list[str] = []
    lora_failed: list[str] = []
    lora_failed_reasons: list[str] = []
    lora_evicted: list[str] = []
    # The prompt rows this step computed, for requests with SamplingParams.prompt_logprobs.
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # Rank 0 ran this step on every core while another process held one (its threads waited for a
    # CPU, evenflow/worker/threads.py): its time is the neighbour's, not what the step's shape costs.
    contended: bool = False
    # Rank 0's long steps run on fewer threads than its plan's for now (a core was taken: the thread
    # rule's fallback), this one included if it was long: what a long step costs differs by about 2x.
    threads_fallback: bool = False


class WorkerConfig(Struct, forbid_unknown_fields=True):
    """Everything a worker process needs to start; passed on its command line as JSON."""

    model: str
    rank: int = 0
    world_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    # The most rows a step may carry (0: max_num_batched_tokens). A layer group is charged its share of its
    # prompt's tokens, so a step with one carries up to twice the budget in the group's layers.
    max_step_rows: int = 0
    max_num_seqs: int = 256
    attention_backend: str = "auto"
    kv_cache_memory: int | None = None  # bytes; None = a share of available memory
    num_kv_blocks: int | None = None
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    dist_init_addr: str = ""  # tcp://127.0.0.1:PORT for torch.distributed when world_size > 1
    engine_input_addr: str = ""  # where SchedulerOutputs come from (engine binds PUB/PUSH)
    engine_output_addr: str = ""  # where results go (engine binds PULL)
    num_threads: int | None = None
    # Links over TCP to an engine-core on another host: CURVE keys from $EVENFLOW_DIST_SECRET.
    secure_link: bool = False
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA off (--enable-lora not given)
    quantization: str | None = None  # GGUF 4-bit projections: None (auto), "gguf" (keep), "none" (dequantize)
    enforce_eager: bool = False  # True: no torch.compile'd ops


class WorkerReady(Struct, tag="worker_ready", array_like=True):
    """A worker loaded its model and measured how many KV blocks it can hold."""

    rank: int
    num_kv_blocks: int
    block_size: int
    attention_backend: str
    dtype: str
    device: str


class InitKVCache(Struct, tag="init_kv", array_like=True):
    """The engine's decision (min over ranks): allocate this many blocks per layer."""

    num_kv_blocks: int


class KVCacheReady(Struct, tag="kv_ready", array_like=True):
    """A worker allocated (and wrote, so it is resident) the KV cache InitKVCache asked for: the
    engine reports ready only after every rank's."""

    rank: int
    num_kv_blocks: int


class WorkerShutdown(Struct, tag="shutdown", array_like=True):
    """Ask workers to exit cleanly."""


class WorkerError(Struct, tag="worker_error", array_like=True):
    """A worker failed; ``message`` carries the root cause (exception type and text)."""

    rank: int
    message: str
    step_id: int = -1


EngineToWorker = SchedulerOutput | InitKVCache | WorkerShutdown
WorkerToEngine = ModelRunnerOutput | WorkerReady | KVCacheReady | WorkerError
