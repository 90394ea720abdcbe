"""A step yielded to short prompts behind a prompt in token chunks, on a synthetic machine (no model): the
short prompts go whole, and the chunk rides beside them in the room they leave (it ran nothing there:
each short prompt cost the long one a step)."""

from __future__ import annotations

from evenflow.core.sched.budget_controller import PREFILL_FLOOR_TOKENS

from .synthetic_timing import SyntheticMachine
from .test_budget_controller import add, run_step
from .test_layered_prefill import LAYERS, scheduler_with_streams

TARGET_S = 30e-3


def long_prompt_steps(per_token: float, short_every: int = 0, short_len: int = 8) -> tuple[int, list[tuple[int, int]], float]:
    """Steps the 2000-token prompt takes beside 8 streams (a layer overruns the room: token chunks), with a
    short one-token-answer prompt arriving every ``short_every`` steps (a measured layer may fit later: it
    climbs); the (long chunk or -1 for a layer group, short) tokens of each step, and the slowest step."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=per_token)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    steps: list[tuple[int, int]] = []
    slowest = 0.0
    while scheduler.requests["long"].num_output_tokens == 0:
        if short_every and len(steps) % short_every == 1:
            add(scheduler, f"short-{len(steps)}", short_len, max_tokens=1)
        output, seconds = run_step(scheduler, machine)
        shorts = [n for r, n in output.num_scheduled_tokens.items() if r.startswith("short") and n > 1]
        assert all(n == short_len for n in shorts)  # whole, never a chunk
        long = -1 if "long" in output.layer_spans else output.num_scheduled_tokens.get("long", 0)  # -1: a layer group
        steps.append((long, sum(shorts)))
        slowest = max(slowest, seconds)
        assert len(steps) < 400
    return len(steps), steps, slowest


def test_the_chunk_rides_beside_a_short_prompt_in_the_room_it_leaves() -> None:
    """Short prompts every third step cost the long prompt at most one step (before: one step each, 42
    against 33 and 84 against 74 here), every step within the target; the chunk beside a short prompt is
    the allowance less the short prompt, give or take the fit's drift."""
    for per_token in (0.3e-3, 0.6e-3):
        alone, _, _ = long_prompt_steps(per_token)
        with_shorts, steps, slowest = long_prompt_steps(per_token, short_every=3)
        assert with_shorts <= alone + 1, (per_token, alone, with_shorts)
        assert slowest <= TARGET_S * 1.001
        beside = [(steps[i - 1][0], long, short) for i, (long, short) in enumerate(steps) if short and long >= 0]
        assert len(beside) >= 4 and all(long >= PREFILL_FLOOR_TOKENS for _, long, _ in beside), beside
        assert all(long + short >= 0.8 * before for before, long, short in beside[1:]), beside


def test_a_short_prompt_that_leaves_less_than_the_floor_takes_the_step_alone() -> None:
    """The room a short prompt leaves is under ``PREFILL_FLOOR_TOKENS``: no sliver of a chunk rides
    beside it (its fixed costs for a handful of tokens); the chunk takes the next step whole, and short
    prompts still get every other step at most."""
    _, steps, slowest = long_prompt_steps(0.6e-3, short_every=3, short_len=24)  # the allowance: 30-36 tokens
    beside = [long for long, short in steps if short]
    assert beside and all(long == 0 for long in beside)
    assert all(not (a[1] and b[1]) for a, b in zip(steps, steps[1:]))  # never two yields in a row
    assert slowest <= TARGET_S * 1.001


def test_a_step_of_a_short_prompt_and_a_chunk_teaches_no_context_its_price() -> None:
    """The short prompt follows no context and the chunk beside it ~1,000 tokens: the step's price of a
    prompt token is neither's, so the measured prices by context (``MeasuredPromptCost``) keep what they had;
    a step of the chunk alone teaches its context's as before."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
    controller = scheduler.budget_controller
    assert controller is not None
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    while scheduler.requests["long"].num_computed_tokens < 1000:
        run_step(scheduler, machine)
    context = scheduler.requests["long"].num_computed_tokens
    counts = [controller.prompt_cost.num_steps(c) for c in (0, context)]
    add(scheduler, "short", 8, max_tokens=1)
    output, _ = run_step(scheduler, machine)
    assert output.num_scheduled_tokens["short"] == 8 and output.num_scheduled_tokens["long"] >= PREFILL_FLOOR_TOKENS
    assert [controller.prompt_cost.num_steps(c) for c in (0, context)] == counts
    output, _ = run_step(scheduler, machine)
    assert "short" not in output.num_scheduled_tokens and output.num_scheduled_tokens["long"] > 1
    assert controller.prompt_cost.num_steps(context) == counts[1] + 1
