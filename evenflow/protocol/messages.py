"""The messages between frontends and the engine-core, and what every conversation shares, as msgspec Structs.

Three conversations use evenflow/protocol's types:

* frontend <-> engine-core (ZMQ DEALER/ROUTER), here: ``Hello`` / ``Ready`` handshake, ``AddRequest``,
  ``Abort``, ``Hold``, ``Heartbeat``, ``UtilityCall`` one way; ``Outputs``, ``Error``, ``UtilityResult``
  back. The stats every ``Outputs`` carries: evenflow/protocol/stats.py.
* engine-core <-> workers: evenflow/protocol/worker_messages.py.
* everybody: ``SamplingParams``, ``TokenLogprobs``, ``PromptLogprobs``, here.

Top-level messages are tagged msgpack arrays: ``[tag, field1, field2, ...]`` in declaration order,
so one decoder per direction accepts exactly the union it expects, and frames stay small.
No pickle anywhere: these Structs are the whole vocabulary of the wire.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Struct

from evenflow.protocol.lora import AdapterRef
from evenflow.protocol.stats import SchedulerStats

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
