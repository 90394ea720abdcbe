"""Prefill by layer groups in the scheduler and the controller, on a synthetic machine (no model): a
prompt beside streams climbs the layers in consecutive spans within the target, its progress and its
blocks' prefix-cache offer wait for its last group, other prompts wait for it, and the switches that
turn it off do."""

from __future__ import annotations

import pytest
from evenflow.core.component_configs import layered_prefill_layers, worker_template
from evenflow.core.engine_config import EngineConfig
from evenflow.core.request import Request
from evenflow.core.sched.config import ConfigError, SchedulerConfig
from evenflow.core.sched.layered_prefill import LayerPrice, group_tokens, may_layer, price_key
from evenflow.core.sched.aim import AIM_MIN_SAMPLES
from evenflow.core.sched.budget_controller import MEASURED_COST_SHARE, BudgetController
from evenflow.core.sched.prefill_gate import RunningSurvey, survey_running
from evenflow.core.sched.scheduler import Scheduler
from evenflow.core.sched.step_time_model import shape_of_step
from evenflow.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

from .synthetic_timing import SyntheticMachine
from .test_budget_controller import add, run_step

LAYERS = 30


def scheduler_with_streams(target_itl_ms: float = 30.0, num_layers: int = LAYERS) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_model_len=4096,
                                          max_num_seqs=64, target_itl_ms=target_itl_ms, num_layers=num_layers))
    for i in range(8):
        add(scheduler, f"stream-{i}", 64, max_tokens=100_000)
    return scheduler


def test_a_long_prompt_beside_streams_climbs_the_layers_within_the_target() -> None:
    """Its groups run in consecutive spans within the target; a long prompt behind it waits, a short
    one arriving mid-climb goes whole beside a group sized to the room it leaves (alone in a step
    between two groups, it left about half of that step's room unused)."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):  # the fit learns the machine on the streams' steps and floor chunks
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    add(scheduler, "long-behind", 1500)
    spans, seconds, kinds, prices = [], [], [], []
    counted = scheduler.get_stats().scheduler.num_scheduled_tokens
    while "long" in scheduler.requests and scheduler.requests["long"].num_output_tokens == 0:
        if len(spans) == 2 and "short" not in scheduler.requests:
            add(scheduler, "short", 40)  # arrives mid-climb: whole, beside the next group
        output, step_s = run_step(scheduler, machine)
        counted += output.total_num_scheduled_tokens - output.num_scheduled_tokens.get("long", 0)
        assert "long-behind" not in output.num_scheduled_tokens  # a long prompt waits for the climb
        seconds.append(step_s)
        if "long" in output.layer_spans:
            kinds.append("group")
            spans.append(output.layer_spans["long"])
            last = spans[-1][1] == LAYERS
            assert scheduler.requests["long"].num_computed_tokens == (2000 if last else 0)
            assert scheduler.kv_cache_manager.num_cached_blocks["long"] == (2000 // 16 if last else 0)
            prices.append(scheduler.budget_controller.layer_price.per_layer_s(price_key(2000, 0), 2000))
            if output.num_scheduled_tokens.get("short", 0) > 1:
                kinds[-1] = "group+short"
                assert output.num_scheduled_tokens["short"] == 40
            assert all(n == 1 for r, n in output.num_scheduled_tokens.items() if r not in ("long", "short"))
        else:
            kinds.append("other")
    assert kinds.count("group+short") == 1 and "other" not in kinds
    # Each group alone measured about the same layer (the fit of the decodes drifts <1% a step here); the
    # one beside the short prompt taught the price nothing (the prompt's share of its step is a guess).
    beside = kinds.index("group+short")
    assert prices[beside] == prices[beside - 1]
    assert all(abs(b / a - 1) < 0.02 for a, b in zip(prices, prices[1:])), prices
    assert spans[0][0] == 0 and spans[-1][1] == LAYERS
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert 2 <= len(spans) < LAYERS  # several layers a step once the price of one is measured
    assert max(seconds) <= 30e-3 * 1.001  # a linear machine is predicted exactly: every step within the target
    assert scheduler.get_stats().scheduler.num_scheduled_tokens == counted + 2000  # its groups add up to its tokens
    counts = scheduler.get_stats().scheduler
    assert (counts.num_layered_prefills, counts.num_layer_group_steps) == (1, len(spans))
    output, _ = run_step(scheduler, machine)
    assert "long-behind" in output.layer_spans  # its turn came: it climbs next



def test_without_streams_or_before_the_fit_prompts_go_in_token_chunks() -> None:
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    add(scheduler, "early", 2000)  # in the controller's warm-up: floor chunks
    output, _ = run_step(scheduler, machine)
    assert not output.layer_spans and output.num_scheduled_tokens["early"] > 0
    alone = Scheduler(SchedulerConfig(num_kv_blocks=4096, max_model_len=4096, target_itl_ms=30.0, num_layers=LAYERS))
    add(alone, "solo", 2000)
    output, _ = run_step(alone, machine)
    assert not output.layer_spans and output.num_scheduled_tokens == {"solo": 2000}  # no stream: the whole budget


def test_what_reads_per_token_rows_or_adapters_is_never_layered() -> None:
    config = SchedulerConfig(num_kv_blocks=64, target_itl_ms=50.0, num_layers=LAYERS)
    plain = Request("a", list(range(1, 101)), SamplingParams(max_tokens=4))
    assert may_layer(config, plain, 100)
    assert not may_layer(config, plain, 1) and not may_layer(config, plain, 4096)
    logprobs = Request("b", list(range(1, 101)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert not may_layer(config, logprobs, 100)
    off = SchedulerConfig(num_kv_blocks=64, target_itl_ms=50.0)
    assert not may_layer(off, plain, 100)


def test_a_layer_group_is_priced_as_its_share_and_then_by_its_own_groups() -> None:
    whole = shape_of_step(4, 400, [(1000, 200)])
    third = shape_of_step(4, 400, [(1000, 200)], chunk_share=1 / 3)
    decodes = shape_of_step(4, 400, [])
    assert third.tokens - decodes.tokens == pytest.approx((whole.tokens - decodes.tokens) / 3)
    assert third.prefill_pairs == pytest.approx(whole.prefill_pairs / 3)
    assert third.requests == whole.requests
    price = LayerPrice()
    later = price_key(1000, 200)
    assert later == price_key(1010, 250) != price_key(1000, 0)  # shapes to a power of two
    assert price.per_layer_s(later, 1000) is None
    price.observe(later, 0.090, 3, 1000)
    assert price.per_layer_s(later, 1000) == pytest.approx(0.030)
    assert price.per_layer_s(later, 1010) == pytest.approx(0.0303)  # a token's share
    assert price.per_layer_s(price_key(1000, 0), 1000) is None
    price.observe(price_key(1000, 0), -0.001, 2, 1000)  # at or under its decodes' prediction: a price of 0
    assert price.per_layer_s(price_key(1000, 0), 1000) == 0.0
    price.observe(later, 0.050, 1, 1000)
    assert price.per_layer_s(later, 1000) == pytest.approx(0.040)


@pytest.mark.parametrize("options", [dict(), dict(target_itl_ms=50.0, max_loras=2)])
def test_layers_without_the_adaptive_budget_or_beside_lora_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="layer groups"):
        SchedulerConfig(num_kv_blocks=64, num_layers=LAYERS, **options).validate()  # type: ignore[arg-type]


def test_the_engine_turns_layers_on_only_under_the_adaptive_budget(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    model = str(tiny_llama)
    assert layered_prefill_layers(EngineConfig(model=model, target_itl_ms=50.0)) == 2
    assert layered_prefill_layers(EngineConfig(model=model, auto_target_itl=True)) == 2
    assert layered_prefill_layers(EngineConfig(model=model)) == 0  # the fixed budget
    assert layered_prefill_layers(EngineConfig(model=model, target_itl_ms=50.0, layered_prefill=False)) == 0
    assert layered_prefill_layers(EngineConfig(model=model, target_itl_ms=50.0, tensor_parallel_size=2)) == 0
    # A step with a layer group carries up to twice the budget in rows: a GPU worker sizes its activations so.
    assert worker_template(EngineConfig(model=model, target_itl_ms=50.0), str(model), 512).max_step_rows == 2 * 2048
    assert worker_template(EngineConfig(model=model), str(model), 512).max_step_rows == 0


def test_an_abort_mid_climb_frees_the_blocks_and_the_next_prompt_goes() -> None:
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    add(scheduler, "next", 2000)
    output, _ = run_step(scheduler, machine)
    assert output.layer_spans["long"][1] < LAYERS
    free = scheduler.kv_cache_manager.num_free_blocks
    scheduler.abort_requests(["long"])
    assert scheduler.kv_cache_manager.num_free_blocks == free + -(-2000 // 16)
    output, _ = run_step(scheduler, machine)
    assert "long" in output.finished_req_ids  # the workers drop its stream
    assert output.layer_spans.get("next", (None,))[0] == 0  # the waiting prompt starts its own climb


def test_a_prompt_whose_one_layer_overruns_the_room_goes_in_token_chunks() -> None:
    """A model whose single layer of the prompt costs more than the aim leaves beside the decodes (the
    small demo model's 8 layers: ~200 ms a layer against a ~130 ms room) cannot climb within the target."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    outputs = [run_step(scheduler, machine)[0] for _ in range(5)]
    assert not any(o.layer_spans for o in outputs)
    assert all(0 < o.num_scheduled_tokens["long"] < 2000 for o in outputs)  # chunks, within the allowance


def test_a_last_group_of_fewer_layers_keeps_the_price_of_a_layer() -> None:
    """A prompt's last group runs the layers it has left, fewer than the room holds: its step is priced,
    and teaches the price of a layer, as those layers. The next prompt's groups are then predicted as
    they run (counted as the room's layers, a last group of one layer priced a layer at a quarter)."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    controller = scheduler.budget_controller
    assert controller is not None
    for _ in range(60):
        run_step(scheduler, machine)
    errors: list[list[float]] = []
    last_spans: list[int] = []
    first_spans: list[int] = []
    for name in ("first", "second", "third"):
        add(scheduler, name, 2000)
        errors.append([])
        while name in scheduler.requests and scheduler.requests[name].num_output_tokens == 0:
            output = scheduler.schedule()
            predicted = controller.predicted_s(output.step_id)
            req_ids = list(output.num_scheduled_tokens)
            sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
            seconds = machine.step_seconds(output)
            scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, req_ids, sampled, forward_s=seconds))
            if name in output.layer_spans and predicted is not None:
                errors[-1].append(seconds / predicted)
                start, end = output.layer_spans[name]
                if start == 0:
                    first_spans.append(end)
                if end == LAYERS:
                    last_spans.append(end - start)
    assert all(errors) and last_spans
    assert any(n < LAYERS // 2 for n in last_spans), last_spans  # a short last group ran
    assert first_spans[0] == 1 and first_spans[1] > 1, first_spans  # a new shape probes one layer, then is priced
    assert all(abs(e - 1) < 0.05 for e in errors[1] + errors[2]), errors  # a linear machine, measured groups


def budget_work(output: SchedulerOutput) -> int:
    """The step's tokens as its budget counts them: a layer group's share of its chunk."""
    shares = sum(group_tokens(output.num_scheduled_tokens[r], span, LAYERS) - output.num_scheduled_tokens[r]
                 for r, span in output.layer_spans.items())
    return output.total_num_scheduled_tokens + shares


def test_a_climb_takes_its_whole_prompt_and_each_group_its_share_of_the_budget() -> None:
    """A prompt as long as the whole budget climbs all of it beside the streams: each group is charged
    its share of the chunk (its tokens through a slice of the layers), so the streams and the short
    prompts started beside it fit the budget too, and no token of it is left for a chunk after the
    climb (32 kept back for new streams left a 2048-token prompt a ~100 ms step of its last 38 tokens).
    A short prompt arriving before each group goes whole beside it; none waits for the climb, and the
    climb never waits a step (charged its whole chunk, it waited for the new streams to finish, ~4 s
    served)."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)
    budget = scheduler.config.max_num_batched_tokens
    add(scheduler, "long", budget)
    kinds: list[str] = []
    while "long" in scheduler.requests and scheduler.requests["long"].num_output_tokens == 0:
        if not kinds or kinds[-1].startswith("group"):
            add(scheduler, f"short-{len(kinds)}", 24, max_tokens=1000)
        output, _ = run_step(scheduler, machine)
        short = any(n == 24 for n in output.num_scheduled_tokens.values())
        if "long" in output.layer_spans:
            kinds.append("group+short" if short else "group")
            assert output.num_scheduled_tokens["long"] == budget
            assert budget_work(output) <= budget < output.total_num_scheduled_tokens
        else:
            assert "long" not in output.num_scheduled_tokens  # no chunk of it outside the climb
            kinds.append("short" if short else "other")
    assert kinds.count("group+short") >= 2 and kinds[-1].startswith("group"), kinds
    assert not {"short", "other"} & set(kinds), kinds


def test_beside_a_climb_a_prompt_goes_whole_or_not_at_all_under_the_partial_prefill_cap() -> None:
    """With vLLM V0's partial-prefill bounds on, a chunk is capped at the allowance split over the
    prefills; a short prompt beside a climb is refused rather than cut by that cap (cut, its first token
    took two more steps and the climb gave up another)."""
    from evenflow.core.sched.prefill_gate import PrefillGate, RunningSurvey

    survey = RunningSurvey(decodes=8, prefills=1)  # the climbing prompt is the running prefill
    gate = PrefillGate(192, 2, 1, 3000, survey, num_waiting=1)
    gate.whole_prompts_only(seats=4)
    short = Request("short", list(range(1, 151)), SamplingParams(max_tokens=4))
    assert gate.chunk_cap == 96
    assert gate.limit(short, 0, 150) == 0 and gate.lets_others_pass(short, 0)
    fits = Request("fits", list(range(1, 81)), SamplingParams(max_tokens=4))
    assert gate.limit(fits, 0, 80) == 80


def test_a_climb_first_in_the_running_order_leaves_room_for_every_stream_behind_it() -> None:
    """Under the priority policy a high-priority prompt runs ahead of 40 streams: its climb's chunk is
    sized to what their decodes leave (sized to the budget left at its place in the order, the whole
    budget, it never fitted beside them and every step went to the streams alone, until they ended)."""
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_model_len=8192,
                                          max_num_seqs=64, target_itl_ms=30.0, num_layers=LAYERS, policy="priority"))
    machine = SyntheticMachine(num_layers=LAYERS)
    for i in range(40):
        scheduler.add_request(Request(f"stream-{i}", [3 + i] * 32, SamplingParams(max_tokens=100_000, ignore_eos=True),
                                      priority=1))
    for _ in range(60):
        run_step(scheduler, machine)
    # A first climb of what the streams leave, then the rest: a running prompt ahead of all of them.
    scheduler.add_request(Request("vip", [9_999] * 5000, SamplingParams(max_tokens=4, ignore_eos=True), priority=0))
    budget = scheduler.config.max_num_batched_tokens
    steps, groups = 0, 0
    while scheduler.requests["vip"].num_output_tokens == 0:
        output, _ = run_step(scheduler, machine)
        steps += 1
        groups += "vip" in output.layer_spans
        assert budget_work(output) <= budget
        assert all(output.num_scheduled_tokens.get(f"stream-{i}", 0) >= 1 for i in range(40))  # nobody skipped
        assert steps < 200, "the climb never fitted beside the streams"
    assert groups >= 2 and scheduler.get_stats().scheduler.num_layered_prefills >= 2


def test_a_short_prompt_goes_whole_between_two_chunks_of_a_long_one() -> None:
    """A long prompt that cannot climb (one layer overruns the room) goes in token chunks; a short prompt
    arriving behind it goes whole in the next step instead of waiting for every chunk, and the long
    prompt never gives up two steps in a row, however many short prompts come."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    kinds: list[str] = []
    waited: list[int] = []
    arrived = 0
    while scheduler.requests["long"].num_output_tokens == 0:
        if len(kinds) >= 2 and len(kinds) % 3 == 2:  # a short prompt every third step
            arrived += 1
            add(scheduler, f"short-{arrived}", 16, max_tokens=1000)  # the allowance: ~30 tokens
            waited.append(0)
        output, _ = run_step(scheduler, machine)
        assert not output.layer_spans
        shorts = [r for r, n in output.num_scheduled_tokens.items() if r.startswith("short") and n > 1]
        assert all(output.num_scheduled_tokens[r] == 16 for r in shorts)  # whole, never a chunk
        kinds.append("short" if shorts else "chunk" if "long" in output.num_scheduled_tokens else "other")
        waited = [w + 1 for w in waited[len(shorts):]]
        assert all(w <= 2 for w in waited), kinds  # at most one chunk step before its turn
        assert len(kinds) < 200
    assert kinds.count("short") == arrived >= 3 and "other" not in kinds
    assert all(not (a == b == "short") for a, b in zip(kinds, kinds[1:]))  # never two yields in a row


def test_short_prompts_behind_a_long_one_wait_for_their_turn_when_the_queue_is_full_of_them() -> None:
    """Short prompts arriving every step take every other step at most: the long prompt still finishes."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    chunks = steps = 0
    while scheduler.requests["long"].num_output_tokens == 0:
        add(scheduler, f"short-{steps}", 12, max_tokens=2)
        output, _ = run_step(scheduler, machine)
        steps += 1
        chunks += "long" in output.num_scheduled_tokens
        assert steps < 400
    assert chunks >= steps // 2


def test_a_prompt_in_chunks_gives_no_step_to_a_short_prompt_that_cannot_go_or_ranks_below_it() -> None:
    """Held by its slow reader, the short prompt first in the queue cannot be admitted: the long prompt
    keeps every chunk (and no prompt behind overtakes it); under the priority policy it gives none to
    a lower-priority one either, and does to one of its own rank."""
    for policy in ("fcfs", "priority"):
        scheduler = Scheduler(SchedulerConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_model_len=4096,
                                              max_num_seqs=64, target_itl_ms=30.0, num_layers=LAYERS, policy=policy))
        machine = SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
        for i in range(8):
            add(scheduler, f"stream-{i}", 64, max_tokens=100_000)
        for _ in range(60):
            run_step(scheduler, machine)
        add(scheduler, "long", 2000)
        run_step(scheduler, machine)
        if policy == "fcfs":
            add(scheduler, "held", 16)
            scheduler.requests["held"].held = True
        else:
            scheduler.add_request(Request("low", [7] * 16, SamplingParams(max_tokens=4), priority=1))
        outputs = [run_step(scheduler, machine)[0] for _ in range(6)]
        assert all("long" in o.num_scheduled_tokens for o in outputs), policy
        if policy == "priority":
            scheduler.add_request(Request("peer", [8] * 16, SamplingParams(max_tokens=4), priority=0))
            outputs = [run_step(scheduler, machine)[0] for _ in range(2)]
            assert any(o.num_scheduled_tokens.get("peer") == 16 and "long" not in o.num_scheduled_tokens
                       for o in outputs)


def test_a_climb_whose_layer_overruns_the_room_goes_on_in_token_chunks() -> None:
    """The machine slows down 10x mid-climb (another process took a core): once a measured layer no longer
    fits the room beside the streams, the prompt stops climbing and goes on in token chunks from its
    first layer, instead of a layer a step far over the target; the next long prompt goes in chunks."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    kinds: list[str] = []
    while scheduler.requests["long"].num_output_tokens == 0:
        output, seconds = run_step(scheduler, machine)
        kinds.append("group" if "long" in output.layer_spans else
                     "chunk" if output.num_scheduled_tokens.get("long", 0) > 1 else "other")
        if kinds.count("group") == 3:
            machine.slowdown = 10.0
        assert len(kinds) < 400
    assert kinds.count("group") >= 3 and "chunk" in kinds
    assert "group" not in kinds[kinds.index("chunk"):]  # once stopped it does not climb again
    assert kinds.index("chunk") - kinds.count("group") <= 3  # stopped at its first measured overrun (overlap: +1)
    stats = scheduler.get_stats().scheduler
    assert stats.num_layered_prefills_stopped == 1 and stats.num_layered_prefills == 0
    add(scheduler, "next", 2000)
    outputs = [run_step(scheduler, machine)[0] for _ in range(3)]
    assert not any(o.layer_spans for o in outputs)


def test_a_climb_whose_layer_overruns_the_room_but_not_the_target_goes_on_a_layer_a_step() -> None:
    """Prompt tokens cost twice as much mid-climb: a layer no longer fits the aim's room, but a step of the
    streams and one layer stays within the target, so the climb keeps its layers and goes on one a step
    (stopped, the layers it had were lost: served, a prompt restarted in chunks 1.5 s into its climb).
    At 3x a layer overruns the target too and the climb stops."""
    for factor, stops in ((2.0, False), (3.0, True)):
        scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.2e-3)
        for _ in range(60):
            run_step(scheduler, machine)
        add(scheduler, "long", 2000)
        groups, slowest, after = 0, 0.0, []
        while scheduler.requests["long"].num_output_tokens == 0:
            output, seconds = run_step(scheduler, machine)
            groups += "long" in output.layer_spans
            if groups == 3:
                machine.per_token = factor * 0.2e-3
            if groups > 3 and "long" in output.layer_spans:
                slowest = max(slowest, seconds)
                start, end = output.layer_spans["long"]
                after.append(end - start)
        stats = scheduler.get_stats().scheduler
        assert (stats.num_layered_prefills_stopped, stats.num_layered_prefills) == ((1, 0) if stops else (0, 1))
        # Going on: one layer a step (a layer is over the aim's room), every group within the target.
        assert stops or (after.count(1) >= 10 and slowest <= 30e-3 * 1.001)


def test_a_room_that_holds_one_layer_but_not_two_keeps_the_prompt_in_token_chunks() -> None:
    """One layer a step would leave a third of every step's room unused; chunks fill it."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.22e-3)
    controller = scheduler.budget_controller
    assert controller is not None
    for _ in range(60):
        run_step(scheduler, machine)
    cost = controller.model.fitted_costs()
    survey = survey_running(scheduler.running, scheduler._long_threshold)
    _, room_s, _ = controller._prompt_room(cost, survey)
    layer_s = machine.per_token * 2000 / LAYERS
    assert layer_s < room_s < 2 * layer_s  # the machine as the test means it
    add(scheduler, "long", 2000)
    outputs = [run_step(scheduler, machine)[0] for _ in range(5)]
    assert not any(o.layer_spans for o in outputs)
    assert all(0 < o.num_scheduled_tokens["long"] < 2000 for o in outputs)


def test_a_short_prompt_behind_a_waiting_long_one_passes_it_between_two_chunks() -> None:
    """A second long prompt waits at the queue's head for the chunked one; a short prompt behind it still
    goes whole in the next step, and the long one keeps its place."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS, per_token=0.6e-3)
    for _ in range(60):
        run_step(scheduler, machine)
    add(scheduler, "long", 2000)
    run_step(scheduler, machine)
    add(scheduler, "long-2", 2000)
    add(scheduler, "short", 16, max_tokens=100)
    outputs = [run_step(scheduler, machine)[0] for _ in range(2)]
    assert any(o.num_scheduled_tokens.get("short") == 16 for o in outputs)
    assert not any("long-2" in o.num_scheduled_tokens for o in outputs)
    assert scheduler.waiting.peek().request_id == "long-2"


def test_a_climb_trusted_with_nothing_else_doubles_its_layers_each_step() -> None:
    """Right after start-up no chunk has run beside the streams, so trust knows only the climb's own
    groups: each that kept the target lets the next take twice its layers. (Rounded to whole tokens, a
    128-token prompt's one layer, 4.27 tokens, trusted 1.9 layers: it climbed one layer a step, 30
    steps, and the streams' other new prompts waited for it, ~3 s served.)"""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)
    assert scheduler.budget_controller.largest_prefill_seen == 0  # type: ignore[union-attr]
    add(scheduler, "short", 128)
    spans = []
    while scheduler.requests["short"].num_output_tokens == 0:
        output, _ = run_step(scheduler, machine)
        if "short" in output.layer_spans:
            spans.append(output.layer_spans["short"])
        assert len(spans) < 10, spans
    sizes = [end - start for start, end in spans]
    assert spans[-1][1] == LAYERS and all(b >= min(2 * a, LAYERS - start) for a, b, (start, _) in
                                         zip(sizes, sizes[1:], spans[1:])), spans


def warm_controller() -> tuple[BudgetController, RunningSurvey]:
    """A controller past its warm-up beside 8 streams, and the survey of its next step."""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)
    assert scheduler.budget_controller is not None
    return scheduler.budget_controller, survey_running(scheduler.running, scheduler._long_threshold)


def test_a_group_beside_short_prompts_runs_on_a_measured_price_in_the_room_they_leave() -> None:
    """Beside short prompts a group never probes nor runs on the fit's price (it would be measured, or
    trusted, on a step it shares), and takes the layers that fit the room the prompts leave."""
    controller, survey = warm_controller()
    key, short = price_key(2000, 0), [(128, 0)]
    controller.largest_prefill_seen = 2000.0  # trust is not what bounds the group
    assert controller.layer_group_beside(survey, short, 2000, 0, LAYERS, most=LAYERS) == 0  # never measured
    controller.layer_price.observe(key, -0.001, 1, 2000)  # measured at nothing: the fit's price
    assert controller.layer_group_beside(survey, short, 2000, 0, LAYERS, most=LAYERS) == 0
    cost = controller.model.fitted_costs()
    _, room_s, _ = controller._prompt_room(cost, survey)
    controller.layer_price.forget(key)
    controller.layer_price.observe(key, room_s / 10, 1, 2000)  # a layer measured at a tenth of the room
    beside_s = controller.chunks_s(cost, short)
    assert 0 < beside_s < room_s
    layers = controller.layer_group_beside(survey, short, 2000, 0, LAYERS, most=LAYERS)
    assert layers == int((room_s - beside_s) / (room_s / 10)) >= 1 and controller._bound_by == "beside"
    assert controller.layer_group_beside(survey, [(1900, 0)], 2000, 0, LAYERS, most=LAYERS) == 0  # no room left


def test_a_layer_price_measured_at_nothing_is_the_fits_share() -> None:
    """A group that ran at or under its decodes' prediction (a young fit overpricing the decodes) prices its
    layer at nothing. Read as a price, every layer fitted the room and the next group took all that were
    left (a climb under a 1 us target then never stopped); read as unmeasured, every group probed one
    layer (a 128-token prompt climbed one layer a step for 30 steps after start-up, served). The fit's
    share of the chunk prices it, and trust bounds the group."""
    controller, survey = warm_controller()
    key = price_key(2000, 0)
    controller.largest_prefill_seen = 2000.0  # trust is not what bounds the probe
    assert controller.layer_group(survey, 2000, 0, LAYERS, next_layer=0, most=LAYERS) == 1  # never measured: a probe
    assert controller._bound_by == "probe"
    controller.layer_price.observe(key, -0.001, 1, 2000)  # the probe ran under its decodes' prediction
    assert controller.layer_price.per_layer_s(key, 2000) == 0.0
    controller.largest_prefill_seen = 2000 / LAYERS  # trust: the probe's layer
    # twice the last group: trust
    assert controller.layer_group(survey, 2000, 0, LAYERS, next_layer=1, most=LAYERS - 1) == 2
    assert controller._bound_by == "trust"
    controller.largest_prefill_seen = 2000.0
    cost = controller.model.fitted_costs()
    _, room_s, _ = controller._prompt_room(cost, survey)
    fit_s, source = controller._layer_price_s(cost, key, 2000, 0, LAYERS)
    assert source == "fit" and fit_s > 0 and int(room_s / fit_s) >= 1
    layers = controller.layer_group(survey, 2000, 0, LAYERS, next_layer=1, most=LAYERS - 1)
    assert layers == min(int(room_s / fit_s), LAYERS - 1)
    # Where the fit's price does not fit the room, the climb goes on by a probe: the fit's guess stops nothing.
    base_s = controller._prompt_room(cost, survey)[0]
    controller._prompt_room = lambda cost, survey: (base_s, fit_s / 2, "aim")  # type: ignore[method-assign]
    assert controller.layer_group(survey, 2000, 0, LAYERS, next_layer=5, most=LAYERS - 5) == 1
    assert controller._bound_by == "probe" and controller.stats.layered_prefills_stopped == 0
    assert controller.layer_price.per_layer_s(key, 2000) == 0.0  # not forgotten


def test_a_layer_is_never_priced_under_its_share_of_the_measured_prompt_token_cost() -> None:
    """A short prompt's layer costs about what the noise of its decodes' prediction is, so groups can
    measure it far below its cost; its share of what prompt tokens beside decodes were measured to cost
    (``MeasuredPromptCost``, the floor token chunks are held to) prices it then, and sizes the group."""
    controller, survey = warm_controller()
    key, tokens = price_key(128, 0), 128
    controller.largest_prefill_seen = 2000.0  # trust is not what bounds the group
    cost = controller.model.fitted_costs()
    _, room_s, _ = controller._prompt_room(cost, survey)
    controller.layer_price.observe(key, room_s / 1000, 1, tokens)  # a layer measured at a thousandth of the room
    assert controller.layer_group(survey, tokens, 0, LAYERS, next_layer=0, most=LAYERS) == LAYERS  # all fit
    per_token_s = 2 * room_s / tokens  # prompt tokens measured at twice the room for the whole prompt
    for _ in range(AIM_MIN_SAMPLES):
        controller.prompt_cost.observe(0.010 + per_token_s * 16, 0.010, 16, 0)
    floor_s = controller._prompt_token_floor_s(0) * tokens / LAYERS
    assert floor_s == pytest.approx(MEASURED_COST_SHARE * per_token_s * tokens / LAYERS)
    assert controller._layer_price_s(cost, key, tokens, 0, LAYERS) == (pytest.approx(floor_s), "measured")
    layers = controller.layer_group(survey, tokens, 0, LAYERS, next_layer=0, most=LAYERS)
    assert layers == int(room_s / floor_s) < LAYERS and controller._bound_by == "aim"


def run_step_on_threads(scheduler: Scheduler, machine: SyntheticMachine, fallback: bool) -> SchedulerOutput:
    """``run_step`` on a worker that reports whether its long steps run on fewer threads (a core taken)."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
    seconds = machine.step_seconds(output)
    scheduler.update_from_output(output, ModelRunnerOutput(output.step_id, req_ids, sampled, forward_s=seconds,
                                                           threads_fallback=fallback))
    return output


def test_layer_prices_learnt_on_fewer_threads_stay_with_that_thread_plan() -> None:
    """While a core is taken the worker runs long steps on fewer threads (ModelRunnerOutput.threads_fallback)
    and a layer costs about twice as much; a climb after the fallback, on every core again, is priced by
    what layers cost there. (One price for both: a served run climbed one layer a step for 20 steps after
    a fallback, at 88 against ~45 ms a layer.)"""
    scheduler, machine = scheduler_with_streams(), SyntheticMachine(num_layers=LAYERS)
    for _ in range(60):
        run_step(scheduler, machine)

    def climb(name: str, fallback: bool) -> list[int]:
        machine.slowdown = 2.0 if fallback else 1.0
        for _ in range(5):  # the streams' steps on the new plan first (a fallback lasts 16+ long steps)
            run_step_on_threads(scheduler, machine, fallback)
        add(scheduler, name, 2000)
        sizes = []
        while scheduler.requests[name].num_output_tokens == 0:
            output = run_step_on_threads(scheduler, machine, fallback)
            if name in output.layer_spans:
                start, end = output.layer_spans[name]
                sizes.append(end - start)
            assert len(sizes) < 40, sizes
        return sizes

    controller = scheduler.budget_controller
    assert controller is not None
    key = price_key(2000, 0)
    every_core = climb("long-1", False)
    price = controller.layer_price.per_layer_s(key, 2000)
    slow = climb("long-2", True)
    assert controller._layer_prices[True].per_layer_s(key, 2000) > 1.5 * price  # type: ignore[operator]
    assert slow[0] == 1 and max(slow) < max(every_core)  # never measured on fewer threads: a probe
    after = climb("long-3", False)
    assert controller.layer_price.per_layer_s(key, 2000) == pytest.approx(price, rel=0.25)
    assert after[0] >= max(every_core[1:]) - 1, (every_core, slow, after)  # no probe, no fallback's price
