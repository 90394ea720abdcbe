"""The budget without flags: the derived target, the aim at the promised percentile, a prompt's
share when the decodes alone take the aim, and the per-step trace."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
from evenflow.core.sched.auto_target import (
    AUTO_TARGET_DECODE_MULTIPLE, AUTO_TARGET_FLOOR_S, AUTO_TARGET_PREFILL_PIECES, AutoTarget,
    PromptStepEstimate,
)
from evenflow.core.sched.aim import AIM_MIN, AIM_START, AIM_WINDOW, GAPS_OVER_TARGET
from evenflow.core.sched.budget_controller import PREFILL_MIN_SHARE
from evenflow.core.sched.budget_trace import TRACE_ENV
from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.scheduler import Scheduler
from evenflow.protocol import ModelRunnerOutput, SchedulerOutput

from .synthetic_timing import SyntheticMachine
from .test_budget_controller import LONG_PROMPT, NUM_STREAMS, add, cut_by_the_allowance, keep_a_long_prompt_waiting


def scheduler_with_streams(**options: object) -> Scheduler:
    config = dict(num_kv_blocks=4096, max_num_batched_tokens=2048, max_model_len=4096, max_num_seqs=64)
    config.update(options)
    scheduler = Scheduler(SchedulerConfig(**config))  # type: ignore[arg-type]
    for i in range(NUM_STREAMS):
        add(scheduler, f"stream-{i}", 64, max_tokens=100_000)
    return scheduler


def step(scheduler: Scheduler, seconds_of: callable) -> tuple[SchedulerOutput, float]:  # type: ignore[valid-type]
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
    seconds = seconds_of(output)
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, req_ids, sampled, forward_s=seconds))
    return output, seconds


def test_the_derived_target_is_the_floor_or_a_multiple_of_the_decode_step() -> None:
    auto = AutoTarget()
    assert auto.target_s == AUTO_TARGET_FLOOR_S  # nothing measured yet
    for _ in range(300):
        auto.observe_decode_step(0.040)
    assert auto.target_s == pytest.approx(AUTO_TARGET_DECODE_MULTIPLE * 0.040, rel=0.03)
    for seconds in ([0.040] * 19 + [2.0]) * 5:  # a rare stall hardly moves the median
        auto.observe_decode_step(seconds)
    assert auto.target_s == pytest.approx(AUTO_TARGET_DECODE_MULTIPLE * 0.040, rel=0.1)


def test_the_prompt_step_is_the_lower_quartile_of_its_estimates_scaled_to_the_budget() -> None:
    estimate = PromptStepEstimate()
    for prompt_s in (0.5, 0.5, 0.5):
        estimate.observe(prompt_s, work_tokens=512, budget_tokens=2048)
    assert estimate.seconds == 0.0  # too few to say
    estimate.observe(9.0, work_tokens=512, budget_tokens=2048)  # one slow step does not move it far
    estimate.observe(0.25, work_tokens=256, budget_tokens=2048)
    assert estimate.seconds == pytest.approx(2.0)
    slowed = PromptStepEstimate()  # a prompt beside a neighbour's work: half the window at 1.5x
    for prompt_s in [0.5] * 8 + [0.75] * 8:
        slowed.observe(prompt_s, work_tokens=512, budget_tokens=2048)
    assert slowed.seconds == pytest.approx(2.0)
    auto = AutoTarget()
    auto.observe_decode_step(0.030)
    assert auto.target_s == pytest.approx(AUTO_TARGET_DECODE_MULTIPLE * 0.030)
    auto.prompt_step_guess_s = 3.0  # the fit's guess stands in only until the prompt step is measured
    assert auto.target_s == pytest.approx(3.0 / AUTO_TARGET_PREFILL_PIECES)
    auto.prompt_step = estimate
    assert auto.target_s == pytest.approx(2.0 / AUTO_TARGET_PREFILL_PIECES)
    auto.decode_step_s = 0.001  # however cheap decoding is, the prompt step sets the target (no cap)
    assert auto.target_s == pytest.approx(2.0 / AUTO_TARGET_PREFILL_PIECES)


def test_a_costly_prompt_step_sets_the_derived_target() -> None:
    """Decodes cheap beside a prefill that is not (a 2048-token step ~20x the decode step; the real GGUF's
    was ~60x with AMX tiles): the target is a sixth of the prompt step, not 8 decode steps, so a long
    prompt climbs in about six steps."""
    machine = SyntheticMachine(fixed=12e-3, per_token=0.8e-3, num_layers=30)
    scheduler = scheduler_with_streams(auto_target_itl=True, num_layers=30)
    decode_only = []
    for i in range(800):
        if i % 100 == 50:
            add(scheduler, f"long-{i}", LONG_PROMPT)
        output, seconds = step(scheduler, machine.step_seconds)
        if output.total_num_scheduled_tokens == len(output.num_scheduled_tokens) == NUM_STREAMS:
            decode_only.append(seconds)
    streams = [c for c in output.scheduled_cached_reqs if c.req_id.startswith("stream")]
    decodes = {c.req_id: 1 for c in streams}
    prompt_step = (machine.step_seconds(SchedulerOutput(0, [], streams, decodes | {streams[0].req_id: 2048}, 2055))
                   - machine.step_seconds(SchedulerOutput(0, [], streams, decodes, NUM_STREAMS)))
    target = scheduler.get_stats().budget.target_itl_s
    assert target > 1.5 * AUTO_TARGET_DECODE_MULTIPLE * float(np.median(decode_only))
    assert target == pytest.approx(prompt_step / AUTO_TARGET_PREFILL_PIECES, rel=0.2)


def test_before_a_chunk_of_the_budget_ran_the_fit_guesses_the_prompt_step() -> None:
    """Short prompts beside the streams teach the fit what prompt tokens cost; with no chunk of a
    quarter of the budget measured yet, its price of the budget's chunk sets the target, so the first
    long prompt climbs by layers instead of crawling in token chunks under 8 decode steps."""
    machine = SyntheticMachine(fixed=12e-3, per_token=0.8e-3, num_layers=30)
    scheduler = scheduler_with_streams(auto_target_itl=True, num_layers=30)
    for i in range(300):
        if i % 30 == 15:
            add(scheduler, f"short-{i}", 128, max_tokens=1)
        step(scheduler, machine.step_seconds)
    auto = scheduler.budget_controller.auto  # type: ignore[union-attr]
    assert auto.prompt_step.seconds == 0.0  # nothing of a quarter of the budget ran
    streams = [c for c in scheduler.schedule().scheduled_cached_reqs if c.req_id.startswith("stream")]
    decodes = {c.req_id: 1 for c in streams}
    prompt_step = (machine.step_seconds(SchedulerOutput(0, [], streams, decodes | {streams[0].req_id: 2048}, 2055))
                   - machine.step_seconds(SchedulerOutput(0, [], streams, decodes, NUM_STREAMS)))
    assert auto.prompt_step_guess_s == pytest.approx(prompt_step, rel=0.25)
    assert auto.target_s == pytest.approx(prompt_step / AUTO_TARGET_PREFILL_PIECES, rel=0.25)
    assert auto.target_s > 1.5 * AUTO_TARGET_DECODE_MULTIPLE * auto.decode_step_s


def test_without_a_target_the_controller_derives_one_from_the_decode_steps() -> None:
    machine = SyntheticMachine(fixed=30e-3, per_token=200e-6)  # a decode step of ~33 ms: 8x that, not the floor
    scheduler = scheduler_with_streams(auto_target_itl=True)
    decode_only, carried = [], []
    for i in range(1000):  # ten long prompts: more steps that fill the aim than the 16 that move it off its start
        if i % 100 == 50:  # decode-only spells between long prompts, as under an interference load
            add(scheduler, f"long-{i}", LONG_PROMPT)
        output, seconds = step(scheduler, machine.step_seconds)
        if i >= 100 and len(output.num_scheduled_tokens) == NUM_STREAMS and output.total_num_scheduled_tokens == NUM_STREAMS:
            decode_only.append(seconds)
        elif i >= 100 and cut_by_the_allowance(scheduler, output):
            carried.append(seconds)
    stats = scheduler.get_stats()
    target_s = AUTO_TARGET_DECODE_MULTIPLE * float(np.median(decode_only))
    target = stats.budget.target_itl_s
    assert target == pytest.approx(target_s, rel=0.05) and target > AUTO_TARGET_FLOOR_S
    # The steps that carry a long prompt fill the aim: from its start below the derived target to the target
    # itself, as the errors of a noiseless machine come in.
    assert carried and max(carried) <= target * 1.05 and np.mean(carried) >= AIM_START * target * 0.95
    assert scheduler.budget_controller.aim_s == pytest.approx(target, rel=0.05)  # type: ignore[union-attr]


def test_a_paused_worker_is_one_slow_step_not_a_new_target() -> None:
    """A worker stopped for 2 s (SIGSTOP: stopped threads wait in no run queue, so the step is not marked
    contended) while it runs a long prompt's chunk is one step at ~10x its prediction. The derived target
    does not move (the prompt step is its window's lower quartile; a prompt step leaves the decode tracker
    alone), the chunks after it shrink while the fit forgets, and within
    two long prompts they are as large as in a run never paused, under an aim no lower."""
    machine = SyntheticMachine(fixed=30e-3, per_token=200e-6)
    runs = {name: scheduler_with_streams(auto_target_itl=True) for name in ("quiet", "paused")}
    targets: dict[str, list[float]] = {name: [] for name in runs}
    chunks: dict[str, list[int]] = {name: [] for name in runs}
    for i in range(700):
        for name, scheduler in runs.items():
            if i % 100 == 50:
                add(scheduler, f"long-{i}", LONG_PROMPT)
            pause = name == "paused" and i == 451  # the second step of the long prompt added at 450
            output, _ = step(scheduler, lambda o: 2.0 if pause else machine.step_seconds(o))
            targets[name].append(scheduler.budget_controller.target_s)  # type: ignore[union-attr]
            chunks[name].append(sum(n for r, n in output.num_scheduled_tokens.items() if r.startswith("long")))
    assert chunks["paused"][451] == chunks["quiet"][451] > 1  # the paused step carried a chunk
    assert chunks["paused"][452] < chunks["quiet"][452]  # the fit's price after it, for a step or two
    assert targets["paused"][451] == pytest.approx(targets["quiet"][451], rel=0.01)
    assert targets["paused"][-1] == pytest.approx(targets["quiet"][-1], rel=0.01)
    # A fit's price of prompt tokens is not forgotten over decode-only steps (they do not excite it): the next
    # prompt takes one step more than unpaused; the one after it, none.
    prefill_steps = {name: [sum(1 for n in c[start:start + 50] if n > 1) for start in (550, 650)]
                     for name, c in chunks.items()}
    assert prefill_steps["paused"][0] <= prefill_steps["quiet"][0] + 1
    assert prefill_steps["paused"][1] <= prefill_steps["quiet"][1]
    aims = {name: s.budget_controller.aim.share for name, s in runs.items()}  # type: ignore[union-attr]
    assert aims["paused"] >= aims["quiet"]


def test_the_aim_lets_about_one_percent_of_the_gaps_run_over_the_target() -> None:
    """On a noisy machine (5% jitter a step), the share of prefill steps over the target settles near
    1% of the gaps (every step here carries prefill), and most steps run close to the target instead of a
    margin below it."""
    machine, rng = SyntheticMachine(), random.Random(0)
    target_s = 10e-3
    scheduler = scheduler_with_streams(target_itl_ms=target_s * 1e3)
    carried = []
    for i in range(3000):
        keep_a_long_prompt_waiting(scheduler, i)
        output, seconds = step(scheduler, lambda o: machine.step_seconds(o) * rng.lognormvariate(0, 0.05))
        if i >= 500 and cut_by_the_allowance(scheduler, output):
            carried.append(seconds)
    over = np.mean(np.array(carried) > target_s)
    assert GAPS_OVER_TARGET / 3 <= over <= GAPS_OVER_TARGET * 3, over
    assert np.percentile(carried, 99) <= target_s * 1.05
    assert np.median(carried) >= target_s * 0.85  # a 95th-percentile margin on every step aimed ~8% lower


def test_steps_far_below_the_aim_do_not_set_it() -> None:
    """Short prompts' whole steps, predicted at a fraction of the aim and noisy (30% a step), beside long
    prompts' chunks that fill it (5%): the aim follows the filled steps' errors, as close to the target as
    they allow (counted too, the short steps' errors held it ~20% lower), and those keep the target."""
    machine, rng = SyntheticMachine(), random.Random(2)
    target_s = 20e-3  # the streams' decodes alone well below it, as served (0.2 of it)
    scheduler = scheduler_with_streams(target_itl_ms=target_s * 1e3)

    def seconds_of(output: SchedulerOutput) -> float:
        prompt_tokens = output.total_num_scheduled_tokens - NUM_STREAMS
        return machine.step_seconds(output) * rng.lognormvariate(0, 0.3 if prompt_tokens < 100 else 0.05)

    carried = []
    for i in range(1500):
        if (i // 50) % 2:
            keep_a_long_prompt_waiting(scheduler, i)
        else:
            add(scheduler, f"short-{i}", 24, max_tokens=1)
        output, seconds = step(scheduler, seconds_of)
        if i >= 500 and cut_by_the_allowance(scheduler, output):
            carried.append(seconds)
    assert scheduler.budget_controller.aim.share >= 0.88  # type: ignore[union-attr]
    assert np.median(carried) >= target_s * 0.85 and np.percentile(carried, 90) <= target_s


def test_the_derived_target_follows_the_decode_step_when_no_step_is_decode_only() -> None:
    """Prompts queued behind each other leave no decode-only step: the decodes' share of the prefill
    steps tells the decode step instead (fed by decode-only steps alone, the target sat at its floor)."""
    machine = SyntheticMachine(fixed=30e-3, per_token=200e-6)
    scheduler = scheduler_with_streams(auto_target_itl=True)
    decode_only = 0
    for i in range(600):
        if not any(r.is_prefilling for r in scheduler.requests.values() if not r.request_id.startswith("stream")):
            add(scheduler, f"long-{i}", LONG_PROMPT)
        output, _ = step(scheduler, machine.step_seconds)
        decode_only += i >= 20 and output.total_num_scheduled_tokens == len(output.num_scheduled_tokens)
    decodes_alone = machine.step_seconds(SchedulerOutput(
        0, [], [c for c in output.scheduled_cached_reqs if c.req_id.startswith("stream")],
        {r: 1 for r in output.num_scheduled_tokens if r.startswith("stream")}, NUM_STREAMS))
    assert decode_only == 0
    assert scheduler.get_stats().budget.target_itl_s == pytest.approx(AUTO_TARGET_DECODE_MULTIPLE * decodes_alone, rel=0.15)


def test_the_aim_comes_back_within_a_window_after_a_burst_of_slow_steps() -> None:
    """Thirty steps at twice their time (a pause of the host) lower the aim while they are in its
    window, and it comes back once they leave it (only the steps that fill the aim enter it: two
    windows of steps here; a tracker that stepped down 5% of the target per slow
    step and up 100x less per fast one took ~1000 steps to come back)."""
    machine, rng = SyntheticMachine(), random.Random(1)
    target_s = 10e-3
    scheduler = scheduler_with_streams(target_itl_ms=target_s * 1e3)
    carried = []
    for i in range(530 + 2 * AIM_WINDOW + 100):
        keep_a_long_prompt_waiting(scheduler, i)
        slow = 2.0 if 500 <= i < 530 else 1.0
        output, seconds = step(scheduler, lambda o: machine.step_seconds(o) * slow * rng.lognormvariate(0, 0.05))
        if i >= 530 + 2 * AIM_WINDOW and cut_by_the_allowance(scheduler, output):
            carried.append(seconds)
    assert len(carried) > 50 and np.median(carried) >= target_s * 0.85


def test_the_aim_comes_back_from_its_floor() -> None:
    """Three hundred steps at three times their time put the aim at its floor; the steps planned there
    still count as filling it (``FILLED_SHARE`` is below the floor), so their errors come in and the aim
    comes back."""
    machine, rng = SyntheticMachine(), random.Random(3)
    target_s = 10e-3
    scheduler = scheduler_with_streams(target_itl_ms=target_s * 1e3)
    controller = scheduler.budget_controller
    assert controller is not None
    floor = 1.0
    for i in range(800 + 2 * AIM_WINDOW + 100):
        keep_a_long_prompt_waiting(scheduler, i)
        slow = 3.0 if 500 <= i < 800 else 1.0
        step(scheduler, lambda o: machine.step_seconds(o) * slow * rng.lognormvariate(0, 0.05))
        if i == 799:
            floor = controller.aim.share
    assert floor == AIM_MIN and controller.aim.share >= 0.85


def test_steps_run_while_a_core_was_taken_teach_the_controller_nothing() -> None:
    """Four steps at 3x their time that the worker marks ``contended`` (its threads waited for a CPU)
    leave the controller as it was: the same allowances after them as on an undisturbed machine. The
    same steps unmarked pull the aim down and shrink the prompt's chunks (served, one neighbour's few
    seconds pinned the aim at its floor and prompts waited 4-5 s for a first token)."""
    machine = SyntheticMachine()
    runs = {name: scheduler_with_streams(target_itl_ms=10.0) for name in ("quiet", "marked", "unmarked")}
    chunks: dict[str, list[int]] = {name: [] for name in runs}
    for i in range(400):
        for name, scheduler in runs.items():
            keep_a_long_prompt_waiting(scheduler, i)
            output = scheduler.schedule()
            req_ids = list(output.num_scheduled_tokens)
            sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
            busy = name != "quiet" and 300 <= i < 304
            seconds = machine.step_seconds(output) * (3.0 if busy else 1.0)
            scheduler.update_from_output(output, ModelRunnerOutput(
                output.step_id, req_ids, sampled, forward_s=seconds, contended=busy and name == "marked"))
            if i >= 304:
                chunks[name].append(sum(n for r, n in output.num_scheduled_tokens.items() if not r.startswith("stream")))
    assert chunks["marked"] == chunks["quiet"]
    aims = {name: s.budget_controller.aim.share for name, s in runs.items()}  # type: ignore[union-attr]
    assert aims["marked"] == pytest.approx(aims["quiet"], rel=1e-3) and aims["unmarked"] < 0.8 * aims["quiet"], aims
    assert sum(chunks["unmarked"]) < 0.9 * sum(chunks["quiet"])


def test_a_prompt_gets_its_share_when_the_decodes_alone_take_the_target() -> None:
    """Decodes alone over the target: the long prompt gets a fifth of each step, not the 16-token floor,
    so its prefill takes about 5x its own compute at most."""
    machine = SyntheticMachine()
    scheduler = scheduler_with_streams(target_itl_ms=1.0)  # decodes alone: ~2.6 ms
    for _ in range(20):
        step(scheduler, machine.step_seconds)
    add(scheduler, "long", LONG_PROMPT)
    shares = []
    while scheduler.requests["long"].num_output_tokens == 0:
        output, seconds = step(scheduler, machine.step_seconds)
        if cut_by_the_allowance(scheduler, output):
            decodes_alone = machine.step_seconds(SchedulerOutput(
                output.step_id, [], [c for c in output.scheduled_cached_reqs if c.req_id != "long"],
                {r: n for r, n in output.num_scheduled_tokens.items() if r != "long"}, NUM_STREAMS))
            shares.append(1 - decodes_alone / seconds)
    assert min(shares[2:]) >= PREFILL_MIN_SHARE * 0.9, min(shares)


def test_the_trace_writes_each_planned_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    machine = SyntheticMachine()
    scheduler = scheduler_with_streams(target_itl_ms=10.0)
    for i in range(60):
        keep_a_long_prompt_waiting(scheduler, i)
        step(scheduler, machine.step_seconds)
    scheduler.budget_controller._trace.file.flush()  # type: ignore[union-attr]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 59 and {r["bound_by"] for r in rows} >= {"warm-up", "aim"}  # the first step: no decodes
    last = [r for r in rows if r["prefill_tokens"]][-1]
    assert last["target_ms"] == 10.0 and last["decodes"] >= NUM_STREAMS and 0 < last["prefill_tokens"] <= last["allowance"]
    assert last["measured_ms"] == pytest.approx(last["predicted_ms"], rel=0.02)  # a noiseless machine, fitted
    times = [r["unix_s"] for r in rows]  # the wall clock ties a step to a client's records
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60


def test_a_chunk_with_no_decodes_beside_it_does_not_grant_trust() -> None:
    """A lone prompt takes the whole budget; that chunk says nothing of what a chunk beside streams may
    cost, so it must not lift the trust bound (it did: a fit that saw no price in prompt tokens then
    gave 1,700 tokens to a step beside 8 streams, 330 ms against a 50 ms target). Chunks beside decodes
    that kept the target grow it, by doubling."""
    machine = SyntheticMachine(fixed=5e-3, per_token=100e-6)
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_model_len=4096,
                                          max_num_seqs=64, target_itl_ms=50.0))
    add(scheduler, "lone", LONG_PROMPT)
    output, _ = step(scheduler, machine.step_seconds)
    controller = scheduler.budget_controller
    assert output.num_scheduled_tokens["lone"] == LONG_PROMPT and controller.largest_prefill_seen == 0
    for i in range(NUM_STREAMS):
        add(scheduler, f"stream-{i}", 64, max_tokens=100_000)
    sizes = []
    for i in range(300):
        keep_a_long_prompt_waiting(scheduler, i)
        output, seconds = step(scheduler, machine.step_seconds)
        assert seconds <= 2 * 0.050 or i < 20  # first the streams start, with no decode beside them
        sizes.append(controller.largest_prefill_seen)
    assert 0 < sizes[20] < sizes[-1]


def test_a_fit_that_prices_prompt_tokens_at_nothing_grows_no_chunk() -> None:
    """Costs fitted below zero (a tiny model's noisy steps: decodes alone predicted at -143 ms) would
    size any chunk as free; the allowance stays at the largest chunk trusted so far."""
    from evenflow.core.sched.budget_controller import MIN_OBSERVATIONS, BudgetController
    from evenflow.core.sched.prefill_gate import RunningSurvey

    controller = BudgetController(target_s=0.050, max_tokens=2048, max_model_len=4096, max_requests=64)
    controller.model.num_observations = MIN_OBSERVATIONS
    controller.largest_prefill_seen = 96
    survey = RunningSurvey(decodes=8, decode_context=8 * 300, prefills=1, first_prefill_context=1000)
    for theta in ([-0.2, 0.5, 0.0, 0.0, 0.0], [0.01, -0.05, 0.0, 0.0, 0.0]):  # decodes alone <= 0; no token price
        controller.model.theta = np.array(theta)
        assert controller.prefill_allowance(survey) == 96, theta


def test_an_allowance_is_sized_by_the_model_that_predicts_the_step() -> None:
    """Fitted on nothing but 16-token chunks beside decodes (the floor's steps), the model may split its
    costs any way that fits them; the allowance must still be the largest P whose *predicted* step is
    within the aim (before, the costs read with negatives as 0 priced the decodes alone over the aim,
    and every allowance stayed at the floor)."""
    from evenflow.core.sched.budget_controller import BudgetController
    from evenflow.core.sched.prefill_gate import RunningSurvey
    from evenflow.core.sched.step_time_model import shape_of_step

    controller = BudgetController(target_s=0.050, max_tokens=2048, max_model_len=4096, max_requests=64)
    rng = np.random.default_rng(3)
    for _ in range(200):
        context = int(rng.integers(0, 2000))
        chunks = [(16, context)] if rng.random() < 0.7 else []
        shape = shape_of_step(8, 8 * 300, chunks)
        controller.model.observe(shape, 4e-3 + 0.3e-3 * shape.tokens + 1e-6 * shape.kv_reads + rng.normal(0, 2e-4))
    controller.largest_prefill_seen = 1024  # trust out of the way
    survey = RunningSurvey(decodes=8, decode_context=8 * 300, prefills=1, first_prefill_context=1000)
    allowance = controller.prefill_allowance(survey)
    predicted = [controller.model.predict(shape_of_step(8, 8 * 300, [(p, 1000)])) for p in range(1, 2041)]
    largest = max((p for p, s in zip(range(1, 2041), predicted) if s <= controller.aim_s), default=16)
    assert allowance > 16 and abs(allowance - largest) <= 1, (allowance, largest)


def test_a_chunk_is_never_priced_below_what_prompt_tokens_measured() -> None:
    """A fit that prices prompt tokens at nothing (served, tiny model: 12-14% of the prefill steps were
    predicted at or under their decodes alone, and 1,000-1,500-token chunks so sized took 114-184 ms
    against a 50 ms target) sizes the chunk by what the last prefill steps measured instead."""
    from evenflow.core.sched.aim import AIM_MIN_SAMPLES
    from evenflow.core.sched.budget_controller import MEASURED_COST_SHARE, MIN_OBSERVATIONS, BudgetController
    from evenflow.core.sched.prefill_gate import RunningSurvey

    controller = BudgetController(target_s=0.050, max_tokens=2048, max_model_len=4096, max_requests=64)
    controller.model.num_observations = MIN_OBSERVATIONS
    controller.largest_prefill_seen = 2048  # trust out of the way
    survey = RunningSurvey(decodes=8, decode_context=8 * 300, prefills=1, first_prefill_context=1000)
    controller.model.theta = np.array([0.010, 0.0, 0.0, 0.0, 0.0])  # the decodes 10 ms, prompt tokens free
    assert controller.prefill_allowance(survey) == 2048 - 8  # unmeasured: the fit's word (and the room)
    for _ in range(AIM_MIN_SAMPLES):  # 64 prompt tokens beside the decodes took 6.4 ms more
        controller.prompt_cost.observe(0.010 + 64 * 1e-4, 0.010, 64, 1000)
    assert controller.prefill_allowance(survey) == int((controller.aim_s - 0.010) / (MEASURED_COST_SHARE * 1e-4))


def test_steps_stay_near_the_target_while_the_fit_prices_prompt_tokens_at_nothing() -> None:
    machine = SyntheticMachine(fixed=5e-3, per_token=100e-6)
    scheduler = scheduler_with_streams(target_itl_ms=50.0)
    controller = scheduler.budget_controller
    assert controller is not None
    for i in range(200):
        keep_a_long_prompt_waiting(scheduler, i)
        step(scheduler, machine.step_seconds)
    controller.largest_prefill_seen = 2048
    worst = 0.0
    for i in range(200, 240):
        keep_a_long_prompt_waiting(scheduler, i)
        controller.model.theta = np.array([0.010, 0.0, 0.0, 0.0, 0.0])  # forced again: the fit learns each step
        output, seconds = step(scheduler, machine.step_seconds)
        worst = max(worst, seconds)
    assert 0.030 < worst <= 0.050 / 0.8  # unmeasured, the fit's word gave 2,040 tokens: ~210 ms


def test_the_target_and_budget_are_logged_every_interval(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import evenflow.core.sched.budget_stats as budget_stats

    monkeypatch.setattr(budget_stats, "LOG_INTERVAL_S", 0.0)
    machine = SyntheticMachine(fixed=30e-3)
    scheduler = scheduler_with_streams(auto_target_itl=True)
    with caplog.at_level(logging.INFO, logger="evenflow.core.sched.budget_controller"):
        for i in range(40):
            step(scheduler, machine.step_seconds)
    line = caplog.records[-1].getMessage()
    assert line.startswith("token budget: target") and "auto: " in line and "ms decode step" in line
    assert f"{scheduler.budget_controller.target_s * 1e3:.1f} ms" in line  # type: ignore[union-attr]
