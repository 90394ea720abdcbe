"""How much prompt work one step may take: the adaptive allowance and the partial-prefill bounds.

The scheduler serves decodes unconditionally; every prefill chunk (a chunk of known tokens before
a request's last one: a new prompt, a continued one, or a recompute after preemption) passes
through this step's ``PrefillGate``:

* ``allowance``: prompt tokens the whole step may carry (``BudgetController``'s choice with
  ``--target-itl-ms``; unlimited otherwise: the token budget alone then bounds the step).
* vLLM V0's partial-prefill bounds, on when ``--max-num-partial-prefills`` N > 1: at most N
  requests get prefill chunks in one step, at most M (``--max-long-partial-prefills``) of them
  long (more than ``--long-prefill-token-threshold`` prompt tokens left, 4% of max_model_len when
  not given); a long prompt refused a slot is skipped in the queue, so shorter prompts behind it go
  first; and one chunk takes at most the allowance split evenly over the prefills that can run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.request import Request


@dataclass
class RunningSurvey:
    """One pass over the running requests: what the step's decodes and prefills will be."""

    decodes: int = 0
    decode_context: int = 0  # tokens the decodes attend to, summed
    prefills: int = 0
    long_prefills: int = 0
    first_prefill_context: int = 0  # context of the first prefill chunk (the one most likely to run)


def survey_running(running: Sequence[Request], long_threshold: int) -> RunningSurvey:
    """Decodes: requests with at most one known token left without KV (drafts ride along)."""
    survey = RunningSurvey()
    decodes = decode_context = prefills = long_prefills = 0
    for request in running:
        computed = request.num_computed_tokens
        left = request.num_tokens - computed
        if left <= 1:
            decodes += 1
            decode_context += computed
        else:
            if prefills == 0:
                survey.first_prefill_context = computed
            prefills += 1
            long_prefills += 0 < long_threshold < left
    survey.decodes, survey.decode_context = decodes, decode_context
    survey.prefills, survey.long_prefills = prefills, long_prefills
    return survey


class PrefillGate:
    """One step's limits on prefill chunks; ``limit`` before allocating, ``commit`` after."""

    is_open = False  # True: limit() returns what it is given and commit() counts nothing

    @classmethod
    def for_step(cls, config: SchedulerConfig, long_threshold: int, running: Sequence[Request], num_waiting: int,
                 choose_allowance: Callable[[RunningSurvey], int] | None) -> PrefillGate:
        """The next step's gate (``choose_allowance``: the controller's choice); an open one when
        neither the allowance nor the bounds are on, so the default path surveys nothing."""
        if choose_allowance is None and config.max_num_partial_prefills == 1:
            return OPEN_GATE
        survey = survey_running(running, long_threshold)
        allowance = config.max_num_batched_tokens if choose_allowance is None else choose_allowance(survey)
        return cls(allowance, config.max_num_partial_prefills, config.max_long_partial_prefills, long_threshold,
                   survey, num_waiting)

    def __init__(self, allowance: int, max_partial: int, max_long: int, long_threshold: int,
                 survey: RunningSurvey, num_waiting: int) -> None:
        self.survey = survey
        self.allowance_left = allowance
        self.bounded = max_partial > 1  # vLLM V0: the bounds apply only when N > 1
        self.max_partial, self.max_long, self.long_threshold = max_partial, max_long, long_threshold
        self.num_prefills = self.num_long = 0  # granted in this step
        self.prefill_tokens = 0
        self.chunks: list[tuple[int, int]] = []  # (new tokens, computed before), for the step-time model
        self.chunk_share = 1.0  # of the layers the chunks run through (a layered prefill's group)
        self.chunks_beside: list[tuple[int, int]] = []  # short prompts whole beside a layered prefill's group
        self.whole_only = False  # only prompts that finish within the allowance (whole_prompts_only) ...
        self.seats = 0  # ... and this many of them
        if self.bounded:
            schedulable = max(1, min(max_partial, survey.prefills + num_waiting))
            self.chunk_cap = max(1, allowance // schedulable)
        else:
            self.chunk_cap = allowance

    def _is_long(self, left: int) -> bool:
        return 0 < self.long_threshold < left

    def lets_others_pass(self, request: Request, num_computed: int) -> bool:
        """A prompt refused only for this step, so shorter ones behind it may go (it keeps its place):
        the long slots are taken, or only short prompts go beside a climb (``whole_prompts_only``)."""
        return self.whole_only or (self.bounded and self._is_long(request.num_tokens - num_computed)
                                   and self.num_long >= self.max_long)

    def limit(self, request: Request, num_computed: int, num_new: int) -> int:
        """``num_new`` cut to what this step lets the request's prefill take (0: nothing)."""
        left = request.num_tokens - num_computed
        if left <= 1:
            return num_new  # a decode: never limited
        if self.bounded and (self.num_prefills >= self.max_partial
                             or (self._is_long(left) and self.num_long >= self.max_long)):
            return 0
        cap = self.allowance_left if self.allowance_left < self.chunk_cap else self.chunk_cap
        if self.whole_only and (num_new < left or num_new > cap or self.num_prefills >= self.seats):
            return 0
        return num_new if num_new < cap else max(cap, 0)

    def commit(self, request: Request, num_computed: int, num_new: int) -> None:
        """Count a scheduled chunk against the limits."""
        left = request.num_tokens - num_computed
        if left <= 1:
            return
        self.num_prefills += 1
        self.num_long += self._is_long(left)
        self.allowance_left -= num_new
        self.prefill_tokens += num_new
        self.chunks.append((num_new, num_computed))


    def close(self) -> None:
        """No prompt chunk in this step (a prompt prefilled by layer groups takes its room)."""
        self.allowance_left = 0

    def whole_prompts_only(self, seats: int) -> None:
        """Only prompts whose rest fits the allowance whole, ``seats`` of them at most: short ones that
        arrived while a prompt climbs the layers (its next group beside them, where their room holds one)
        or goes in token chunks (its next chunk in the step after: the scheduler's ``_yielded``)."""
        self.whole_only = True
        self.seats = seats

    def reopen_chunks(self) -> None:
        """After the short prompts of a ``whole_prompts_only`` step: a chunk may take what they left."""
        self.whole_only = False

    def fits_whole(self, request: Request, max_num_batched_tokens: int) -> bool:
        """Whether a waiting prompt would prefill whole within this step's allowance, beside its decodes."""
        return (1 < request.num_tokens <= self.allowance_left
                and request.num_tokens + self.survey.decodes <= max_num_batched_tokens)

    def commit_layer_group(self, num_new: int, num_computed: int, share: float) -> None:
        """Count a layered prefill's step: its chunk through ``share`` of the layers; the short prompts
        committed before it ride beside it (``chunks_beside``)."""
        self.chunks_beside = self.chunks
        self.chunks = [(num_new, num_computed)]
        self.chunk_share = share
        self.prefill_tokens = num_new
        self.num_prefills += 1
        self.allowance_left = 0


class OpenPrefillGate(PrefillGate):
    """The default gate: the step's token budget alone limits prefill chunks (one, stateless)."""

    is_open = True

    def __init__(self) -> None:
        super().__init__(0, 1, 1, 0, RunningSurvey(), 0)

    def lets_others_pass(self, request: Request, num_computed: int) -> bool:
        return False

    def limit(self, request: Request, num_computed: int, num_new: int) -> int:
        return num_new

    def commit(self, request: Request, num_computed: int, num_new: int) -> None:
        pass


OPEN_GATE = OpenPrefillGate()
