"""The budget controller's part in prompts prefilled by layer groups: whether a prompt climbs, and how
many layers each of its steps runs (what a climb is and why: layered_prefill.py).

A group is sized as a prompt chunk is: the layers whose price fits the aim's room beside the step's
decodes (``BudgetController._prompt_room``), bounded by trust. A layer's price is what groups of the
same shape measured (``LayerPrice``), or the fit's share of the whole chunk. Short prompts admitted
whole in the step (the streams' new requests) take their predicted time out of that room first, and
the group beside them runs only on a measured price: it never probes, and never stops the climb.
"""

from __future__ import annotations

from typing import Callable, Literal

from evenflow.core.sched.budget_stats import BudgetStats
from evenflow.core.sched.budget_trace import BudgetTrace, PlannedStep
from evenflow.core.sched.layered_prefill import LayerPrice, price_key
from evenflow.core.sched.prefill_gate import RunningSurvey
from evenflow.core.sched.step_time_model import StepCosts, StepTimeModel, chunk_pairs

MIN_OBSERVATIONS = 8  # steps observed before the model's prediction is trusted over the floor
TRUST_GROWTH = 2.0
# Layers of a prompt a step's room must hold for it to climb rather than go in token chunks: a room of
# 1.5 layers runs one and leaves the rest of every step unused, where a chunk fills it.
MIN_LAYERS_A_STEP = 2

LayerPriceSource = Literal["measured", "fit", "unknown"]  # where a layer's price comes from (_layer_price_s)


class LayerGroupSizing:
    """``BudgetController``'s layer-group decisions (its state; its rules for the room and the floor)."""

    model: StepTimeModel
    stats: BudgetStats
    layer_price: LayerPrice
    largest_prefill_seen: float
    target_s: float
    _trace: BudgetTrace | None
    _pending_trace: PlannedStep | None
    _pending_layers: tuple[tuple[int, int], int, float] | None
    _bound_by: str
    # BudgetController's rules, which the groups share with its token allowances
    aim_s: float
    _prompt_room: Callable[[StepCosts, RunningSurvey], tuple[float, float, str]]
    _prompt_token_floor_s: Callable[[int], float]

    def prefers_layers(self, survey: RunningSurvey, num_tokens: int, num_computed: int, num_layers: int) -> bool:
        """Whether a prompt chunk (``num_tokens`` after ``num_computed``) that the step's allowance cuts
        goes by layer groups instead (layered_prefill.py): past the fit's warm-up, beside decodes, where
        ``MIN_LAYERS_A_STEP`` of its layers fit the aim's room beside them (else every group would
        overrun or leave the room unused: it goes in chunks)."""
        if not survey.decodes or self.model.num_observations < MIN_OBSERVATIONS:
            return False
        cost = self.model.fitted_costs()
        _, room_s, bound_by = self._prompt_room(cost, survey)
        if bound_by != "aim":  # the decodes alone take the aim: the prompt goes in chunks of its share
            return False
        per_layer_s, _ = self._layer_price_s(cost, price_key(num_tokens, num_computed), num_tokens, num_computed,
                                             num_layers)
        return 0 < per_layer_s * min(MIN_LAYERS_A_STEP, num_layers) <= room_s

    def chunks_s(self, cost: StepCosts, chunks: list[tuple[int, int]]) -> float:
        """What prompt chunks (tokens, computed before them) add to a step beside its decodes, by the fit,
        and never less than the prompt tokens' measured floor."""
        return sum(cost.per_request + self._chunk_s(cost, num_tokens, num_computed)
                   for num_tokens, num_computed in chunks)

    def _chunk_s(self, cost: StepCosts, num_tokens: int, num_computed: int) -> float:
        """A chunk's tokens, reads and pairs by the fit, and never less than the prompt tokens' measured floor."""
        fit_s = (cost.per_token * num_tokens + cost.per_read * (num_computed + num_tokens)
                 + cost.per_pair * chunk_pairs(num_tokens, num_computed))
        return max(fit_s, self._prompt_token_floor_s(num_computed) * num_tokens)

    def _layer_price_s(self, cost: StepCosts, key: tuple[int, int], num_tokens: int, num_computed: int,
                       num_layers: int) -> tuple[float, LayerPriceSource]:
        """One layer of the chunk beside the decodes, and where that price comes from: "measured" by groups
        of its shape (``LayerPrice``); else the fit's share of the whole chunk, "fit" where groups of the
        shape ran within the fit's error of their decodes alone (measuring the layer at nothing), "unknown"
        where none ran yet (or the fit prices the chunk at nothing). Never under its share of the prompt
        tokens' measured floor, as a token chunk is (``_chunk_s``): a short prompt's layer costs about what
        the noise of its decodes' prediction is, and groups of 128-token prompts priced under two thirds of
        their cost took all 30 layers in a step, 1.1-1.6x a ~270 ms target (served on the real GGUF, AVX2)."""
        measured_s = self.layer_price.per_layer_s(key, num_tokens)
        if measured_s is not None and measured_s > 0:
            return max(measured_s, self._prompt_token_floor_s(num_computed) * num_tokens / num_layers), "measured"
        fit_s = self._chunk_s(cost, num_tokens, num_computed) / num_layers
        return fit_s, "fit" if measured_s is not None and fit_s > 0 else "unknown"

    def layer_group(self, survey: RunningSurvey, num_tokens: int, num_computed: int, num_layers: int,
                    next_layer: int, most: int) -> int:
        """Layers a prompt prefilled by layer groups (``num_tokens`` after ``num_computed``) runs through in
        the next step, from ``next_layer`` on (layered_prefill.py): the layers whose price fits the aim's
        room beside the decodes, at least one, at most ``most`` (those left whose share of the chunk the
        step's token budget holds); bounded by trust as an allowance is, in tokens x share. A shape no
        group measured yet runs one layer, which measures it (the fit's share of a whole chunk overran by
        up to 1.7x); one whose groups measured their layer at nothing is priced by the fit, the error the
        groups ran within (probed again instead, every group ran one layer: a short prompt climbed 30 steps
        right after start-up), and probes one layer where that price does not fit the room. A measured
        layer over the aim's room but within the target runs alone (stopped, the climb's layers so far
        would be lost). 0: a layer of it, as measured, overruns the target beside the decodes (or, before
        its first group ran, the room): what the fit foresaw was too little, and the climb stops to go on
        in token chunks within the target (docs/tuning.md)."""
        if survey.decodes == 0:
            self._bound_by = "room"
            return most
        if self.model.num_observations < MIN_OBSERVATIONS:
            self._bound_by = "warm-up"
            return 1
        cost = self.model.fitted_costs()
        base_s, room_s, self._bound_by = self._prompt_room(cost, survey)
        key = price_key(num_tokens, num_computed)
        per_layer_s, source = self._layer_price_s(cost, key, num_tokens, num_computed, num_layers)
        layers = int(room_s / per_layer_s) if per_layer_s > 0 else num_layers
        measured = source == "measured"
        if measured and layers < 1 and next_layer > 0 and max(base_s, 0.0) + per_layer_s <= self.target_s:
            layers, self._bound_by = 1, "target"
        elif measured and layers < 1:
            self._bound_by = "overrun"
            self.stats.layered_prefills_stopped += 1
            self.layer_price.forget(key)
            return 0
        probe = source == "unknown" or layers < 1  # never measured, or the fit's price does not fit: measure it
        if probe:
            layers, self._bound_by = 1, "probe"
        return self._commit_group(survey, key, layers, -1.0 if probe else per_layer_s, base_s, num_tokens,
                                  num_layers, most)

    def layer_group_beside(self, survey: RunningSurvey, chunks: list[tuple[int, int]], num_tokens: int,
                           num_computed: int, num_layers: int, most: int) -> int:
        """``layer_group`` in a step that carries short prompts whole (``chunks``: their tokens and the
        tokens computed before them): the layers whose measured price fits the room the prompts leave.
        0: none this step (no room left, or no measured price: a probe or a fit's price beside them would
        be measured or trusted on a step they share). The climb goes on at the next step either way."""
        if not survey.decodes or self.model.num_observations < MIN_OBSERVATIONS:
            return 0
        cost = self.model.fitted_costs()
        base_s, room_s, bound_by = self._prompt_room(cost, survey)
        key = price_key(num_tokens, num_computed)
        per_layer_s, source = self._layer_price_s(cost, key, num_tokens, num_computed, num_layers)
        if bound_by != "aim" or source != "measured":  # a measured price is > 0
            return 0
        beside_s = self.chunks_s(cost, chunks)
        layers = int((room_s - beside_s) / per_layer_s)
        if layers < 1:
            return 0
        self._bound_by = "beside"
        return self._commit_group(survey, key, layers, per_layer_s, base_s + beside_s, num_tokens, num_layers,
                                  most)

    def _commit_group(self, survey: RunningSurvey, key: tuple[int, int], layers: int, per_layer_s: float,
                      base_s: float, num_tokens: int, num_layers: int, most: int) -> int:
        """The group's layers, bounded by trust and ``most``, remembered until the step is recorded
        (``per_layer_s`` -1: a probe, its price unknown)."""
        # Twice the last group's layers when it kept the target, unrounded: rounded, a climb trusted with
        # nothing else (no chunk beside decodes yet) stayed at one layer a step.
        trusted = int(num_layers * TRUST_GROWTH * self.largest_prefill_seen / num_tokens + 1e-6)
        if trusted < layers:
            layers, self._bound_by = trusted, "trust"
        if layers < 1:
            layers, self._bound_by = 1, "floor"
        layers = min(layers, most)
        self.stats.layer_group_steps += 1
        self._pending_layers = (key, layers, -1.0 if per_layer_s < 0 else layers * per_layer_s)
        if self._trace is not None:
            self._pending_trace = PlannedStep(-1, self.target_s * 1e3, self.aim_s * 1e3, survey.decodes,
                                              base_s * 1e3, layers, f"layers:{self._bound_by}")
        return layers
