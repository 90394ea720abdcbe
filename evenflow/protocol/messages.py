"""Every message that crosses a process boundary, as msgspec Structs.

Three conversations share these types:

* frontend <-> engine-core (ZMQ DEALER/ROUTER): ``Hello`` / ``Ready`` handshake, ``AddRequest``,
  ``Abort``, ``Heartbeat``, ``UtilityCall`` one way; ``Outputs``, ``Error``, ``UtilityResult`` back.
* engine-core <-> workers: ``WorkerReady`` / ``InitKVCache`` handshake, ``SchedulerOutput`` to every
  rank, ``ModelRunnerOutput`` (or ``WorkerError``) back from rank 0.
* everybody: ``SamplingParams``.

Top-level messages are tagged msgpack arrays: ``[tag, field1, field2, ...]`` in declaration order,
so one decoder per direction accepts exactly the union it expects, and frames stay small.
No pickle anywhere: these Structs are the whole vocabulary of the wire.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Struct

from evenflow.protocol.lora import AdapterRef, LoRAConfig
from evenflow.protocol.speculative import SpeculativeConfig

# The wire's integers are int64 (evenflow/protocol/README.md): msgpack can also carry uint64, which a
# decoder typed ``int`` would accept, so every field a client sends is bounded to int64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]

# --------------------------------------------------------------------------------------------
# Shared
# --------------------------------------------------------------------------------------------


class StructuredOutputsParams(Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A grammar the output must follow (vLLM's ``structured_outputs``): exactly one field is set.

    ``json`` is a JSON schema serialized as a string (the engine's cache key is the text, so a
    client should serialize canonically: sorted keys, no spaces); ``json_object`` asks for any
    JSON object; ``regex`` is a regular expression the whole output matches; ``choice`` lists the
    only allowed outputs; ``grammar`` is a Lark grammar (llguidance's dialect).
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kind_and_spec(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the one constraint set, None when none is; raises ValueError on two."""
        set_fields = [(k, v) for k, v in (("json", self.json), ("regex", self.regex), ("grammar", self.grammar))
                      if v is not None]
        if self.choice is not None:
            set_fields.append(("choice", msgspec.json.encode(self.choice).decode()))
        if self.json_object:
            set_fields.append(("json_object", ""))
        if len(set_fields) > 1:
            raise ValueError(f"structured_outputs sets {', '.join(k for k, _ in set_fields)}: set exactly one")
        return set_fields[0] if set_fields else None


class SamplingParams(Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick tokens for one request (one sample; the frontend fans out ``n``).

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k. ``logprobs`` is the number of
    top alternatives to report per sampled token (``None``: no logprobs at all; ``0``: only the
    sampled token's own logprob). The range rules live in ``evenflow/protocol/validation.py``.
    """

    max_tokens: Int64 = 16
    min_tokens: Int64 = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    min_p: float = 0.0
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[Int64] = []
    ignore_eos: bool = False
    logprobs: Int64 | None = None
    # Constrained decoding (a grammar); None: free text. Requests with one are never speculated.
    structured_outputs: StructuredOutputsParams | None = None
    # Per prompt token, its logprob and the top-k at its position (vLLM's prompt_logprobs); a
    # request with it never reads the prefix cache, so that every position is computed.
    prompt_logprobs: Int64 | None = None


class TokenLogprobs(Struct, array_like=True):
    """Logprobs of one sampled token: the sampled token first, then the top-n alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


class PromptLogprobs(Struct, array_like=True):
    """Logprobs of consecutive prompt tokens, one row each: the prompt token first, then the top-k
    at its position (rows of one request come in prompt order, chunk by chunk)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # 1-based rank of each prompt token in its position's distribution

    def extend(self, more: "PromptLogprobs") -> None:
        self.token_ids.extend(more.token_ids)
        self.logprobs.extend(more.logprobs)
        self.ranks.extend(more.ranks)


# --------------------------------------------------------------------------------------------
# engine-core <-> workers
# --------------------------------------------------------------------------------------------


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

# --------------------------------------------------------------------------------------------
# frontend <-> engine-core
# --------------------------------------------------------------------------------------------


class Hello(Struct, tag="hello", array_like=True, forbid_unknown_fields=True):
    """First message of a frontend: its protocol version and a name for logs."""

    protocol_version: Int64
    client_name: str = ""


class AddRequest(Struct, tag="request", array_like=True, forbid_unknown_fields=True):
    """Submit a request. ``request_id`` is unique among this client's live requests."""

    request_id: str
    prompt_token_ids: list[Int64]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: Int64 = 0
    arrival_time: float = 0.0  # unix seconds at the frontend; 0 = when the engine receives it
    # Seconds the engine may hold this request before aborting it with ``request_timeout``
    # (counted from its arrival at the engine); 0 = the engine's --request-timeout (0: none).
    timeout_s: float = 0.0
    # A LoRA adapter loaded on the engine (Ready.lora_adapters, or a load_lora_adapter call); "": the base model.
    lora_name: str = ""


class Abort(Struct, tag="abort", array_like=True, forbid_unknown_fields=True):
    """Abort requests of this client; unknown or finished ids are ignored."""

    request_ids: list[str]


class Hold(Struct, tag="hold", array_like=True, forbid_unknown_fields=True):
    """Backpressure: ``hold=True`` stops scheduling these requests (their KV stays; nothing more is
    generated for them) until a ``hold=False`` for them; unknown or finished ids are ignored."""

    request_ids: list[str]
    hold: bool


class Heartbeat(Struct, tag="heartbeat", array_like=True):
    """Liveness ping; the engine answers with an (empty) Outputs carrying fresh stats."""


class LoRALoad(Struct, array_like=True, forbid_unknown_fields=True):
    """Arguments of ``load_lora_adapter`` (``lora_path`` set) and ``unload_lora_adapter``."""

    lora_name: str
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter of that name (new weights: a new identity)


class UtilityCall(Struct, tag="utility", array_like=True, forbid_unknown_fields=True):
    """Call an engine method by name: ``reset_prefix_cache``, ``get_stats``, ``list_lora_adapters``,
    ``load_lora_adapter`` / ``unload_lora_adapter`` (with ``lora``)."""

    call_id: Int64
    method: str
    lora: LoRALoad | None = None


FrontendToEngine = Hello | AddRequest | Abort | Hold | Heartbeat | UtilityCall


class Ready(Struct, tag="ready", array_like=True):
    """Answer to Hello: the facts a frontend needs about the served model and engine."""

    protocol_version: int
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    engine_id: str
    max_frame_bytes: int = 0  # the engine's --max-frame-bytes; 0 = unknown (an older engine)
    # Other names the model answers to (the folder's base name when no --served-model-name was given).
    model_aliases: list[str] = []
    # LoRA adapters served (by name in AddRequest.lora_name); None: LoRA off (--enable-lora not given).
    lora_adapters: list[AdapterRef] | None = None


class RequestOutput(Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since its previous RequestOutput.

    ``finish_reason`` is set on the last one: "stop" (EOS or a stop token), "length"
    (max_tokens or max_model_len), "abort", or "error".
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    # Seconds from arrival to first being scheduled; set on the request's first output only.
    queue_time_s: float | None = None
    # Prompt tokens 1.. (the first has none), on the request's first output only.
    prompt_logprobs: PromptLogprobs | None = None


class SchedulerStats(Struct, array_like=True):
    """A snapshot of the engine's state, sent with every Outputs message."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative tokens computed for prompts (prefill)
    num_generation_tokens: int = 0  # cumulative tokens sampled
    schedule_s: float = 0.0  # cumulative seconds in Scheduler.schedule
    update_s: float = 0.0  # cumulative seconds in Scheduler.update_from_output
    worker_prepare_s: float = 0.0  # cumulative worker seconds building inputs
    worker_forward_s: float = 0.0  # cumulative worker seconds in the forward pass
    worker_sample_s: float = 0.0  # cumulative worker seconds sampling
    worker_idle_s: float = 0.0  # cumulative seconds the engine had no step in flight
    num_scheduled_tokens: int = 0  # cumulative sum of every step's scheduled tokens (recomputation included)
    # Structured output (cumulative): grammar compiles per histogram bucket (bounds in
    # evenflow/protocol/structured_outputs.py COMPILE_BUCKETS_S, last = +Inf), their seconds, and cache hits.
    grammar_compile_buckets: list[int] = []
    grammar_compile_s: float = 0.0
    grammar_cache_hits: int = 0
    # --target-itl-ms (all 0 when off): the step-time target, the last step's chosen token budget
    # (its decodes + the prefill allowed beside them), per-bucket counts of chosen budgets (bucket i:
    # budgets in (2**(i-1), 2**i]) and their sum, and over steps that carried decodes: predicted and measured
    # seconds summed, steps, steps whose measured time was within the target.
    target_itl_s: float = 0.0
    token_budget: int = 0
    token_budget_log2_counts: list[int] = []
    token_budget_sum: int = 0
    step_predicted_s: float = 0.0
    step_measured_s: float = 0.0
    num_controlled_steps: int = 0
    num_steps_within_target: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters).
    spec_decode_num_drafts: int = 0  # (request, step) pairs that verified at least one draft
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []  # index i: drafts accepted at position i


class KVCacheEvents(Struct, array_like=True, omit_defaults=True):
    """Prefix-cache changes since the engine's previous report, for frontends that route by prefix.

    ``stored``: block hashes (evenflow/protocol/block_hash.py) newly cached; ``removed``: hashes evicted.
    Each hash appears at most once, in its latest state. ``cleared``: the whole cache was reset
    before these changes.
    """

    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False


class Outputs(Struct, tag="outputs", array_like=True):
    """Outputs for one client's requests after a step, and the engine's stats.

    ``kv_events`` is broadcast to every client (with empty ``outputs``), batched over steps.
    """

    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    kv_events: KVCacheEvents | None = None


class Error(Struct, tag="error", array_like=True):
    """Something went wrong. ``request_id`` is set when it concerns one request (that request is
    finished); otherwise it concerns the connection or the whole engine (``fatal``: the engine is
    going away and every pending request of this client is lost)."""

    code: str
    message: str
    request_id: str | None = None
    fatal: bool = False


class UtilityResult(Struct, tag="utility_result", array_like=True):
    call_id: int
    ok: bool
    result: SchedulerStats | bool | None = None
    message: str = ""
    # The LoRA calls: every adapter served after the call.
    lora_adapters: list[AdapterRef] = []


EngineToFrontend = Ready | Outputs | Error | UtilityResult

# Error codes (also listed in evenflow/protocol/README.md).
ERR_BAD_FRAME = "bad_frame"  # undecodable bytes, unknown tag, wrong field type, oversize
ERR_VERSION = "version_mismatch"
ERR_NOT_READY = "no_hello"  # a message before Hello (or after the engine forgot the client)
ERR_CLIENT_DROPPED = "client_dropped"  # unsolicited: the engine dropped a silent client, its requests aborted
ERR_INVALID_REQUEST = "invalid_request"  # bad params, out-of-vocab ids, too long prompt
ERR_DUPLICATE_ID = "duplicate_request_id"
ERR_WORKER_DIED = "worker_died"
ERR_ENGINE_SHUTDOWN = "engine_shutdown"
ERR_UNKNOWN_METHOD = "unknown_method"
ERR_OVERLOADED = "overloaded"  # refused by an admission limit; the message starts with the limit's name
ERR_REQUEST_TIMEOUT = "request_timeout"  # the request outlived its deadline and was aborted
ERR_UNKNOWN_LORA_ADAPTER = "unknown_lora_adapter"  # lora_name names no adapter the engine serves (now)


def to_json(obj: Struct) -> bytes:
    return msgspec.json.encode(obj)
