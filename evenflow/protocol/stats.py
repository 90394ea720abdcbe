"""``SchedulerStats``: the engine's state, sent with every ``Outputs``, one sub-struct per owner.

Each owner writes only its own part (the scheduler, the KV cache manager, the engine's step timing,
structured outputs, the adaptive budget, speculative decoding). A feature adds a field at the end of
its owner's struct, or a new owner adds a struct at the end of ``SchedulerStats``: the other parts
keep their positions on the wire. Every struct is a msgpack array whose trailing fields have
defaults, so a decoder fills what an older engine leaves out and ignores what a newer one adds.
"""

from __future__ import annotations

from msgspec import Struct, field


class SchedulerCounts(Struct, array_like=True):
    """The scheduler's own numbers (evenflow/core/sched/scheduler.py)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative steps that ran something
    num_prompt_tokens: int = 0  # cumulative tokens computed for prompts (prefill)
    num_generation_tokens: int = 0  # cumulative tokens sampled
    num_scheduled_tokens: int = 0  # cumulative sum of every step's scheduled tokens (recomputation included; a layer group its share)
    schedule_s: float = 0.0  # cumulative seconds in Scheduler.schedule
    update_s: float = 0.0  # cumulative seconds in Scheduler.update_from_output
    num_layered_prefills: int = 0  # cumulative prompt chunks prefilled by layer groups (counted at their last)
    num_layer_group_steps: int = 0  # cumulative steps that carried a layer group
    num_layered_prefills_stopped: int = 0  # cumulative climbs stopped for token chunks (a layer overran the room)


class KVCacheStats(Struct, array_like=True):
    """The KV cache manager's (evenflow/core/kv/manager.py)."""

    usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens


class WorkerTimingStats(Struct, array_like=True):
    """Rank 0's cumulative seconds, summed by the engine (evenflow/core/step_timing.py)."""

    prepare_s: float = 0.0  # building inputs
    forward_s: float = 0.0  # the forward pass
    sample_s: float = 0.0  # sampling
    idle_s: float = 0.0  # waiting for the engine-core while it had work
    num_contended_steps: int = 0  # steps run on every core while another process held one


class GrammarStats(Struct, array_like=True):
    """Structured outputs, cumulative (evenflow/core/sched/structured_output.py)."""

    # Grammar compiles per histogram bucket: bounds in evenflow/protocol/structured_outputs.py
    # COMPILE_BUCKETS_S, the last one +Inf.
    compile_buckets: list[int] = []
    compile_s: float = 0.0
    cache_hits: int = 0  # requests whose grammar was already compiled or compiling


class TokenBudgetStats(Struct, array_like=True):
    """The adaptive budget, ``--target-itl-ms`` (evenflow/core/sched/budget_controller.py); all 0 when off.

    Budget buckets: bucket i counts chosen budgets in (2**(i-1), 2**i]. The predicted and measured
    seconds and the step counts cover the steps that carried decodes.
    """

    target_itl_s: float = 0.0
    token_budget: int = 0  # chosen for the last step: its decodes + the prefill allowed beside them
    token_budget_log2_counts: list[int] = []
    token_budget_sum: int = 0
    step_predicted_s: float = 0.0
    step_measured_s: float = 0.0
    num_controlled_steps: int = 0
    num_steps_within_target: int = 0  # measured time within the target


class SpecDecodingStats(Struct, array_like=True):
    """Speculative decoding, cumulative, vLLM's names (evenflow/core/sched/draft_slots.py)."""

    num_drafts: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # index i: drafts accepted at position i


class SchedulerStats(Struct, array_like=True):
    """A snapshot of the engine's state, sent with every Outputs message: one part per owner."""

    scheduler: SchedulerCounts = field(default_factory=SchedulerCounts)
    kv_cache: KVCacheStats = field(default_factory=KVCacheStats)
    workers: WorkerTimingStats = field(default_factory=WorkerTimingStats)
    grammar: GrammarStats = field(default_factory=GrammarStats)
    budget: TokenBudgetStats = field(default_factory=TokenBudgetStats)
    spec_decode: SpecDecodingStats = field(default_factory=SpecDecodingStats)
