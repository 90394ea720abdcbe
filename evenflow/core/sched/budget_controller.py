"""``--target-itl-ms``: each step's prefill allowance, chosen so the decoding streams stay on target.

Before a step, the decodes it will carry are known (``RunningSurvey``). The controller predicts,
with the ``StepTimeModel`` fitted to past steps, the time of those decodes plus P prompt tokens,
and allows the largest P whose prediction stays within the step's aim. The time is quadratic in P
(a chunk of P tokens after C computed ones attends to P*C + P*(P+1)/2 pairs), so P is one square
root, not a search.

* Decodes are never limited; only the prefill riding along is.
* The aim is the promised percentile, not every step: the target is a p99 of the streams' gaps,
  so about 1% of the gaps may run over it (``Aim``, evenflow/core/sched/aim.py); the aim is at most
  ``STALL_BOUND`` x the target.
* A prompt's share: when the decodes alone are predicted to take the whole aim, a step with a prompt
  to prefill gives it ``PREFILL_MIN_SHARE`` (a fifth) of its predicted time, so a long prompt beside
  streams that already miss the target still prefills at about a fifth of its unchunked rate, not
  at the 16-token floor: its first token comes at most ~5x later than unchunked, whatever target
  was asked for. (While the target can be met, it is: no share is forced on it.)
* A floor (``PREFILL_FLOOR_TOKENS``) keeps prompts moving before the model is trusted.
* With no decodes running there are no streams to protect: the whole budget goes to prompts.
* Trust: P is at most twice the largest prompt chunk that ran beside decodes within the target (or
  within ``TRUSTED_ERROR`` of its prediction, when the decodes alone take the target), so
  a model that has only seen small steps grows its steps by doubling instead of extrapolating far.
  Steps with no decodes take the whole budget and do not count: beside decodes, a fit that saw no
  price in prompt tokens would be trusted with all of it.
* Measured: a chunk is never priced below ``MEASURED_COST_SHARE`` of what prompt tokens beside
  decodes cost in the last ``MEASURED_WINDOW`` prefill steps whose chunk followed a context of the
  same power of two (``MeasuredPromptCost``), in its allowance and in its step's prediction: a fit
  can price them at nothing while it predicts the steps it saw well.
* Without a target given (``auto_target``), the target is derived from the decode step and the
  prompt step (``AutoTarget``); ``--max-num-batched-tokens`` is then the ceiling. The decode step is measured
  on decode-only steps; while none has run for ``DECODE_ONLY_STALE`` steps (prompts queued behind
  each other), a prefill step's measured time scaled by the model's share of its decodes stands in
  (not always: the two estimates differ by up to +-20%).
* A prompt the allowance would cut may climb the layers instead; how many a step is the controller's
  ``LayerGroupSizing`` (evenflow/core/sched/layer_group_sizing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.protocol import ModelRunnerOutput, SchedulerOutput, SchedulerStats

from evenflow.core.sched.aim import AIM_MIN_SAMPLES, FILLED_SHARE, Aim
from evenflow.core.sched.auto_target import PROMPT_STEP_MIN_SHARE, AutoTarget
from evenflow.core.sched.budget_stats import BudgetLog, BudgetStats
from evenflow.core.sched.budget_trace import BudgetTrace, PlannedStep
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.layer_group_sizing import MIN_OBSERVATIONS, TRUST_GROWTH, LayerGroupSizing
from evenflow.core.sched.layered_prefill import LayerPrice
from evenflow.core.sched.prefill_gate import PrefillGate, RunningSurvey
from evenflow.core.sched.step_time_model import (
    MeasuredPromptCost, StepCosts, StepShape, StepTimeModel, chunk_pairs, largest_chunk_within, shape_of_step,
)

PREFILL_FLOOR_TOKENS = 16
TRUSTED_ERROR = 1.25  # measured / predicted of a step whose chunk the model is trusted with
AIM_WARM_UP = 4 * MIN_OBSERVATIONS  # steps fitted before errors count: a young fit's errors are not the machine's
DECODE_ONLY_STALE = 64  # decode-carrying steps with no decode-only one before prefill steps tell the decode step
PREFILL_MIN_SHARE = 0.2  # of a step's predicted time, for a prompt to prefill beside decodes
# The fit may price a prompt token down to this share of what the last prefill steps measured
# (MeasuredPromptCost); below it the measured cost sizes the chunk and predicts its step.
MEASURED_COST_SHARE = 0.8
MEASURED_WINDOW = 64  # prefill steps a context bucket remembers
UNAIMED = ("share", "floor", "warm-up", "probe")  # allowances the aim did not size: their steps do not move it


@dataclass
class _Planned:
    shape: StepShape
    predicted_s: float
    has_decodes: bool
    prefill_share: float = 0.0  # its prompt work in tokens through every layer, unrounded (a group: tokens x share)
    decodes_alone_s: float = 0.0  # the model's prediction of the step without its prompt chunks
    filled: bool = False  # its prompt work was sized to the aim (not the share or the floor) and fills it (aim.py)
    prefill_context: int = 0  # computed tokens before its prompt chunks (the most of them: the costliest)
    # Its chunks follow contexts of different sizes (a short prompt and a long one's chunk beside it): what a
    # token cost after one of them is not told apart from the other's (MeasuredPromptCost learns nothing).
    mixed_contexts: bool = False
    # Short prompts rode beside its layer group: their share of its time is the fit's guess (up to 1.5x their
    # time, served), so the step teaches nothing of prompt tokens, layers or decodes.
    beside: bool = False
    # a layered prefill's group: its layers, its chunk's tokens and its price's key
    layers: int = 0
    layer_tokens: int = 0
    layer_key: tuple[int, int] = (0, 0)
    trace: PlannedStep | None = None

    @property
    def prefill_tokens(self) -> int:
        return round(self.prefill_share)

    @property
    def has_prefill(self) -> bool:  # unrounded: one layer of a short prompt in a deep model rounds to 0 tokens
        return self.prefill_share > 0


class BudgetController(LayerGroupSizing):
    """Chooses prefill allowances for a target step time and learns from the steps that ran."""

    def __init__(self, target_s: float | None, max_tokens: int, max_model_len: int, max_requests: int) -> None:
        """``target_s`` None: the target is derived from the measured steps (``AutoTarget``)."""
        self.auto = AutoTarget() if target_s is None else None
        self._given_target_s = target_s
        self.aim = Aim()
        self.max_tokens = max_tokens
        self.model = StepTimeModel(max_tokens, max_model_len, max_requests)
        self.prompt_cost = MeasuredPromptCost(MEASURED_WINDOW, max_model_len)
        # The largest prompt work beside decodes that kept the target, in tokens through every layer
        # (a layer group's: its tokens x its share of the layers, unrounded).
        self.largest_prefill_seen = 0.0
        self._since_decode_only = DECODE_ONLY_STALE  # decode-carrying steps since the last decode-only one
        self.stats = BudgetStats()
        self._planned: dict[int, _Planned] = {}  # step_id -> what was predicted for it
        self._trace = BudgetTrace.from_env()
        self._pending_trace: PlannedStep | None = None  # prefill_allowance's decision, until record()
        # Layer prices apart for the worker's two thread plans: every core, and fewer while a core is taken
        # (ModelRunnerOutput.threads_fallback). One price for both took a fallback's 2x price into the
        # climbs after it (a served run climbed one layer a step for 20 steps at 88 against ~45 ms a layer).
        self._layer_prices = (LayerPrice(), LayerPrice())
        self._threads_fallback = False  # the plan of the last step measured, the next one's likely plan
        self._pending_layers: tuple[tuple[int, int], int, float] | None = None  # layer_group's, until record()
        self._bound_by = ""  # which rule set the last allowance
        self._log = BudgetLog()

    @property
    def target_s(self) -> float:
        """The streams' target: the one given, or the one derived from the steps so far (``AutoTarget``)."""
        return self.auto.target_s if self.auto is not None else self._given_target_s  # type: ignore[return-value]

    @property
    def layer_price(self) -> LayerPrice:
        """What layers cost on the thread plan the worker runs long steps on now."""
        return self._layer_prices[self._threads_fallback]

    @classmethod
    def for_config(cls, config: SchedulerConfig) -> BudgetController | None:
        if config.auto_target_itl:
            return cls(None, config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs)
        if config.target_itl_ms is None:
            return None
        return cls(config.target_itl_ms / 1000, config.max_num_batched_tokens, config.max_model_len,
                   config.max_num_seqs)

    def prefill_allowance(self, survey: RunningSurvey) -> int:
        """Prompt tokens the next step may carry beside its ``survey.decodes`` decodes."""
        room = max(self.max_tokens - survey.decodes, 0)
        base_s = 0.0
        if survey.decodes == 0:
            allowance, bound_by = room, "room"
        elif self.model.num_observations < MIN_OBSERVATIONS:
            allowance, bound_by = PREFILL_FLOOR_TOKENS, "warm-up"
        else:
            cost = self.model.fitted_costs()
            base_s, room_s, bound_by = self._prompt_room(cost, survey)
            allowance = self._largest_within(cost, survey, base_s, base_s + room_s)
            floor_s = self._prompt_token_floor_s(survey.first_prefill_context)
            measured = int((room_s + min(base_s, 0.0)) / floor_s) if floor_s > 0 else allowance
            if measured < allowance:
                allowance, bound_by = measured, "measured"
            trust = int(TRUST_GROWTH * self.largest_prefill_seen)
            if allowance > trust:
                allowance, bound_by = trust, "trust"
            if allowance < PREFILL_FLOOR_TOKENS:
                allowance, bound_by = PREFILL_FLOOR_TOKENS, "floor"
        if allowance > room:
            allowance, bound_by = room, "room"
        self.stats.count_budget(survey.decodes + allowance)
        self._bound_by = bound_by
        if self._trace is not None and survey.decodes:
            self._pending_trace = PlannedStep(-1, self.target_s * 1e3, self.aim_s * 1e3, survey.decodes,
                                              base_s * 1e3, allowance, bound_by)
        return allowance

    def _prompt_room(self, cost: StepCosts, survey: RunningSurvey) -> tuple[float, float, str]:
        """The step's decodes alone (predicted), the seconds a prompt may add beside them, and the rule
        that set those: the aim's room, or, where the decodes alone take the aim, the prompt's share of
        the step (rather than a crawl at the floor; over ``STALL_BOUND`` then: past it already)."""
        base_s = self._base_seconds(cost, survey)
        if base_s < self.aim_s:
            return base_s, self.aim_s - base_s, "aim"
        return base_s, base_s * PREFILL_MIN_SHARE / (1 - PREFILL_MIN_SHARE), "share"

    @staticmethod
    def _base_seconds(cost: StepCosts, survey: RunningSurvey) -> float:
        """The step's decodes alone (and a prefill request's fixed share), predicted."""
        d, c = survey.decodes, survey.first_prefill_context
        return (cost.fixed + cost.per_token * d + cost.per_read * (survey.decode_context + d + c)
                + cost.per_request * (d + max(survey.prefills, 1)))

    def _prompt_token_floor_s(self, context: int) -> float:
        """The least a prompt token beside decodes after ``context`` is priced at (0.0: too few
        steps measured there)."""
        if self.prompt_cost.num_steps(context) < AIM_MIN_SAMPLES:
            return 0.0
        return MEASURED_COST_SHARE * self.prompt_cost.per_token_s(context)

    def _largest_within(self, cost: StepCosts, survey: RunningSurvey, base_s: float, seconds: float) -> int:
        """The largest P whose step (``base_s`` plus a chunk of P after the first prefill's context) is
        predicted within ``seconds``; where the fit sees no price in prompt tokens, the largest chunk
        trusted so far (a doubling on its word took a tiny model's step to 2.1x its target)."""
        if base_s <= 0:  # a fit that prices the decodes alone at nothing or less says nothing of a chunk
            return int(self.largest_prefill_seen)
        chunk = largest_chunk_within(cost, survey.first_prefill_context, seconds - base_s)
        return int(self.largest_prefill_seen) if chunk is None else int(min(chunk, self.max_tokens))

    def record(self, output: SchedulerOutput, gate: PrefillGate) -> None:
        """Remember what the scheduled step holds and what it should cost, until its time arrives."""
        if output.total_num_scheduled_tokens == 0:
            return
        survey = gate.survey
        beside = sum(num_new for num_new, _ in gate.chunks_beside)
        drafts = max(output.total_num_scheduled_tokens - survey.decodes - gate.prefill_tokens - beside, 0)
        shape = shape_of_step(survey.decodes, survey.decode_context, gate.chunks, drafts, gate.chunk_share)
        # A layered prefill's group counts as its share of the chunk's tokens (trust, the measured cost).
        prefill_tokens = round(gate.prefill_tokens * gate.chunk_share)
        step_id = output.step_id
        self._planned.pop(step_id - 8, None)  # a step never sent (an engine shutting down) is not kept
        # Without its prompt work: the decodes, and beside a layer group the short prompts that ride with it.
        alone_s = self.model.predict(shape_of_step(survey.decodes, survey.decode_context, [], drafts))
        if gate.chunks_beside:
            alone_s = max(alone_s, 0.0) + self.chunks_s(self.model.fitted_costs(), gate.chunks_beside)
        predicted_s = self.model.predict(shape)
        contexts = [computed for _, computed in gate.chunks]
        context = max(contexts, default=0)  # its tokens priced after the costliest context, as the allowance was
        if survey.decodes and prefill_tokens:
            floor_s = self._prompt_token_floor_s(context)
            predicted_s = max(predicted_s, max(alone_s, 0.0) + floor_s * prefill_tokens)
        layered, self._pending_layers = self._pending_layers, None
        if layered is not None and gate.chunk_share < 1:
            key, layers, measured_s = layered
            if measured_s >= 0:  # priced (by earlier groups of its shape, or the fit); -1: a probe
                predicted_s = max(alone_s, 0.0) + measured_s
        prefill_share = gate.prefill_tokens * gate.chunk_share
        filled = (survey.decodes > 0 and prefill_share > 0 and self._bound_by not in UNAIMED
                  and predicted_s >= FILLED_SHARE * self.target_s)
        planned = _Planned(shape, predicted_s, survey.decodes > 0, prefill_share, alone_s, filled, context,
                           not self.prompt_cost.same_bucket(contexts), bool(gate.chunks_beside))
        if layered is not None and gate.chunk_share < 1:
            planned.layers, planned.layer_key, planned.layer_tokens = layered[1], layered[0], gate.prefill_tokens
        if self._pending_trace is not None:
            planned.trace, self._pending_trace = self._pending_trace, None
            planned.trace.step_id, planned.trace.prefill_tokens = step_id, prefill_tokens
            planned.trace.predicted_ms = planned.predicted_s * 1e3
        self._planned[step_id] = planned

    def predicted_s(self, step_id: int) -> float | None:
        """The model's prediction for a step scheduled and not yet observed (the step watchdog's yardstick)."""
        planned = self._planned.get(step_id)
        return planned.predicted_s if planned is not None and self.model.num_observations >= MIN_OBSERVATIONS else None

    def observe(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Fit the model to one step's measured time: rank 0's wait for it (the engine-core's share of
        the step's period: zero unless the loop fell behind), input building, forward and sampling."""
        planned = self._planned.pop(output.step_id, None)
        seconds = result.wait_s + result.prepare_s + result.forward_s + result.sample_s
        if planned is None or seconds <= 0:  # an idle step's output says nothing of the thread plan
            return
        self._threads_fallback = result.threads_fallback
        if result.contended:
            self._count_contended(planned, seconds)
            return
        if planned.has_decodes and (seconds <= self.target_s or seconds <= TRUSTED_ERROR * planned.predicted_s):
            self.largest_prefill_seen = max(self.largest_prefill_seen, planned.prefill_share)
        if planned.layers and not planned.beside:
            self.layer_price.observe(planned.layer_key, seconds - max(planned.decodes_alone_s, 0.0), planned.layers,
                                     planned.layer_tokens)
        if (self.auto is not None and planned.has_prefill and not planned.beside
                and self.model.num_observations >= MIN_OBSERVATIONS):  # its decodes' share is the fit's
            self._follow_prompt_step(planned, seconds)
        if planned.has_decodes and planned.predicted_s > 0 and self.model.num_observations >= MIN_OBSERVATIONS:
            self.stats.count_step(planned.predicted_s, seconds, self.target_s)
            self._follow(planned, seconds)
        if planned.trace is not None and self._trace is not None:
            planned.trace.measured_ms = seconds * 1e3
            self._trace.write(planned.trace)
        # A layer group is priced by its own (LayerPrice), beside the fit's decodes: fitted to groups too, the
        # fit would give the decodes a share of a group's slow-down.
        if not planned.layers and not planned.beside:
            self.model.observe(planned.shape, seconds)
            self._guess_prompt_step()
        if self._log.due():
            source = (f"auto: {self.auto.decode_step_s * 1e3:.1f} ms decode step, "
                      f"{self.auto.prompt_step_s * 1e3:.0f} ms prompt step" if self.auto is not None
                      else "--target-itl-ms")
            self._log.write(self.stats, self.target_s, self.aim_s, source, self.max_tokens)

    def _count_contended(self, planned: _Planned, seconds: float) -> None:
        """A step the worker ran while another process held a core (``ModelRunnerOutput.contended``):
        the streams waited for it, so the stats count it, but its time is not what its shape costs on
        this machine, so neither the fit, the aim, the layer prices, the trust nor the derived target
        learn from it (a neighbour's few seconds would pin the aim at its floor for the next 256 prompt
        steps). The worker leaves the busy core to it for the steps that follow; their times, on
        fewer threads, are the machine's, and are learnt."""
        if planned.has_decodes and planned.predicted_s > 0 and self.model.num_observations >= MIN_OBSERVATIONS:
            self.stats.count_step(planned.predicted_s, seconds, self.target_s)
            self.aim.follow_step(planned.filled)  # one of the streams' gaps all the same
        if planned.trace is not None and self._trace is not None:
            planned.trace.measured_ms, planned.trace.contended = seconds * 1e3, True
            self._trace.write(planned.trace)

    @property
    def aim_s(self) -> float:
        """The predicted step time a prompt's allowance is sized to."""
        return self.aim.share * self.target_s

    def _follow(self, planned: _Planned, seconds: float) -> None:
        """Feed one decode-carrying step back: the aim (a step that filled it), and the derived target."""
        self.aim.follow_step(planned.filled)
        if planned.has_prefill and not planned.beside and not planned.mixed_contexts:
            self.prompt_cost.observe(seconds, planned.decodes_alone_s, planned.prefill_tokens,
                                     planned.prefill_context)
        if planned.filled and self.model.num_observations >= AIM_WARM_UP:
            self.aim.follow_error(seconds / planned.predicted_s)
        if self.auto is not None:
            decode_s = seconds
            self._since_decode_only = self._since_decode_only + 1 if planned.has_prefill else 0
            if planned.has_prefill:  # the decodes' share of the measured step, by the model
                stale = self._since_decode_only >= DECODE_ONLY_STALE or self.auto.decode_step_s == 0.0
                stale = stale and not planned.beside
                decode_s *= min(max(planned.decodes_alone_s / planned.predicted_s, 0.0), 1.0) if stale else 0.0
            if decode_s > 0:
                self.auto.observe_decode_step(decode_s)  # the aim keeps its share of a moved target

    def _follow_prompt_step(self, planned: _Planned, seconds: float) -> None:
        """Feed the derived target's prompt step (auto_target.py) a step whose prompt chunk (a layer group's
        chunk, or a token chunk) spans ``PROMPT_STEP_MIN_SHARE`` of the token budget or more: its time beyond
        its decodes (the model's prediction of them), for its prompt work."""
        assert self.auto is not None
        chunk = planned.layer_tokens if planned.layers else planned.prefill_tokens
        if chunk < PROMPT_STEP_MIN_SHARE * self.max_tokens:
            return
        self.auto.prompt_step.observe(seconds - max(planned.decodes_alone_s, 0.0), planned.prefill_share,
                                      self.max_tokens)

    def _guess_prompt_step(self) -> None:
        """Until the derived target's prompt step is measured, the fit's price of a prompt chunk of the
        whole budget alone (its tokens, their reads and pairs), once the fit is past its warm-up and
        has seen prompt tokens beside decodes (before that it knows no price for them)."""
        if (self.auto is None or self.auto.prompt_step.seconds or not self.largest_prefill_seen
                or self.model.num_observations < AIM_WARM_UP):
            return
        cost, budget = self.model.fitted_costs(), self.max_tokens
        self.auto.prompt_step_guess_s = max((cost.per_token + cost.per_read) * budget
                                            + cost.per_pair * chunk_pairs(budget, 0), 0.0)

    def fill_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """Write the adaptive budget's part of the scheduler's stats."""
        return self.stats.fill(stats, self.target_s)
