"""A prompt prefilled by layer groups (SchedulerOutput.layer_spans) beside decoding requests, driven by
hand-built steps: the prompt's tokens and the decodes' tokens equal transformers' greedy ones, however
the layers are cut, and the worker refuses spans it cannot continue."""

from __future__ import annotations

from pathlib import Path

import pytest
from evenflow.core.sched.budget_controller import BudgetController
from evenflow.core.sched.layered_prefill import LayerPrice
from evenflow.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from evenflow.worker.runner import ModelRunner

from tests.checkpoints import make_checkpoint, reference_greedy
from tests.worker.harness import Job, RunResult, greedy, make_runner, run_jobs

LAYERS = 5


@pytest.fixture(scope="module")
def five_layers(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, num_hidden_layers=LAYERS)


def step(step_id: int, sched: dict[str, int], new: list[NewRequestData] | None = None,
         cached: list[CachedRequestData] | None = None, spans: dict[str, tuple[int, int]] | None = None,
         finished: list[str] | None = None, preempted: list[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(step_id, new or [], cached or [], sched, sum(sched.values()),
                           finished_req_ids=finished or [], preempted_req_ids=preempted or [],
                           layer_spans=spans or {})


@pytest.mark.parametrize("cuts", [[0, 5], [0, 1, 5], [0, 2, 3, 5], [0, 1, 2, 3, 4, 5]])
def test_layer_groups_beside_a_decode_give_the_reference_tokens(five_layers: Path, cuts: list[int]) -> None:
    runner = make_runner(five_layers, num_blocks=64, block_size=4)
    stream, prompt = [3, 9, 27, 81, 200], [5, 17, 99, 23, 42, 7, 8, 150, 61, 3, 77]
    want_stream, want_prompt = reference_greedy(five_layers, stream, 8), reference_greedy(five_layers, prompt, 3)
    out = runner.execute_model(step(0, {"s": 5}, new=[NewRequestData("s", stream, greedy(8), [0, 1], 0)]))
    got_stream = out.sampled_token_ids[0]
    step_id = 1
    spans = list(zip(cuts, cuts[1:]))
    for i, span in enumerate(spans):  # the stream decodes one token a step while the prompt climbs the layers
        computed = len(stream) + len(got_stream) - 1
        new_blocks = [2] if computed == 8 else []
        cached = [CachedRequestData("s", new_blocks, computed)]
        new = [NewRequestData("p", prompt, greedy(3), [10, 11, 12], 0)] if i == 0 else []
        if i > 0:
            cached.append(CachedRequestData("p", [], 0))
        out = runner.execute_model(step(step_id, {"s": 1, "p": len(prompt)}, new, cached, {"p": span}))
        step_id += 1
        by_req = dict(zip(out.req_ids, out.sampled_token_ids))
        got_stream += by_req["s"]
        assert by_req["p"] == ([] if span[1] < LAYERS else by_req["p"])
        assert len(runner.layered_hidden) == (1 if span[1] < LAYERS else 0)
    got_prompt = by_req["p"]
    assert len(got_prompt) == 1
    while len(got_prompt) < 3 or len(got_stream) < 8:
        sched, cached = {}, []
        for req, toks, base, n in (("s", got_stream, stream, 8), ("p", got_prompt, prompt, 3)):
            if len(toks) < n:
                computed = len(base) + len(toks) - 1
                cached.append(CachedRequestData(req, [13] if req == "p" and computed == 12 else
                                                [2] if req == "s" and computed == 8 else [], computed))
                sched[req] = 1
        out = runner.execute_model(step(step_id, sched, cached=cached))
        step_id += 1
        for req, toks in zip(out.req_ids, out.sampled_token_ids):
            (got_stream if req == "s" else got_prompt).extend(toks)
    assert got_prompt == want_prompt
    assert got_stream == want_stream


def test_a_layered_prompt_alone_and_one_dropped_midway(five_layers: Path) -> None:
    """The prompt may be the whole step (its decodes finished): layers outside its span run nothing.
    Preempted between its groups, the worker drops its stream; a span continuing it then is refused."""
    runner = make_runner(five_layers, num_blocks=64, block_size=4)
    prompt = [5, 17, 99, 23, 42, 7, 8, 150, 61, 3, 77]
    want = reference_greedy(five_layers, prompt, 1)
    new = [NewRequestData("p", prompt, greedy(1), [10, 11, 12], 0)]
    assert runner.execute_model(step(0, {"p": 11}, new, spans={"p": (0, 2)})).sampled_token_ids == [[]]
    cached = [CachedRequestData("p", [], 0)]
    assert runner.execute_model(step(1, {"p": 11}, cached=cached, spans={"p": (2, 3)})).sampled_token_ids == [[]]
    assert runner.execute_model(step(2, {"p": 11}, cached=cached, spans={"p": (3, 5)})).sampled_token_ids == [want]
    new = [NewRequestData("q", prompt, greedy(1), [20, 21, 22], 0)]
    runner.execute_model(step(3, {"q": 11}, new, spans={"q": (0, 2)}))
    runner.execute_model(step(4, {}, preempted=["q"]))
    assert len(runner.layered_hidden) == 0
    resumed = [CachedRequestData("q", [20, 21, 22], 0, resumed_from_preemption=True)]
    with pytest.raises(ValueError, match="holds no such stream"):
        runner.execute_model(step(5, {"q": 11}, cached=resumed, spans={"q": (2, 5)}))


def test_spans_outside_the_model_are_refused(five_layers: Path) -> None:
    runner = make_runner(five_layers, num_blocks=64, block_size=4)
    new = [NewRequestData("p", [1, 2, 3, 4, 5], greedy(1), [0, 1], 0)]
    with pytest.raises(ValueError, match="not a span"):
        runner.execute_model(step(0, {"p": 5}, new, spans={"p": (3, 7)}))


# ------------------------------------------------------------------ through the scheduler

@pytest.fixture
def layers_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt the allowance would cut starts by layer groups (the controller's choice between
    groups and chunks is tested on a synthetic machine: tests/core/test_layered_prefill.py)."""
    monkeypatch.setattr(BudgetController, "prefers_layers", lambda *args: True)


@pytest.fixture
def layers_preferred(layers_started: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and climbs to its last layer, at least one a step, though a layer overruns the room."""
    group = BudgetController.layer_group
    monkeypatch.setattr(BudgetController, "layer_group", lambda *args: max(group(*args), 1))


def _layered_jobs() -> list[Job]:
    streams = [Job(f"s{i}", [3 + i, 9, 27, 81, 200 - i], 60) for i in range(3)]
    prompts = [Job("long", [(7 * t + 5) % 250 + 1 for t in range(70)], 6, arrive_step=12),
               Job("again", [(7 * t + 5) % 250 + 1 for t in range(70)] + [9, 9], 4, arrive_step=40),
               Job("later", [(11 * t + 2) % 250 + 1 for t in range(45)], 5, arrive_step=16),
               Job("short", [17, 4, 99, 23, 5], 5, arrive_step=13)]
    return streams + prompts


def _run_exact(runner: ModelRunner, model: Path, jobs: list[Job], overlap: bool) -> RunResult:
    """The jobs under a target no step can meet; every output checked against transformers."""
    result = run_jobs(runner, jobs, num_blocks=128, budget=256, overlap=overlap,
                      scheduler_overrides={"target_itl_ms": 0.001, "num_layers": LAYERS})
    for job in jobs:
        assert result.outputs[job.req_id] == reference_greedy(model, job.prompt, job.max_tokens), job.req_id
    return result


@pytest.mark.parametrize("overlap", [False, True])
def test_prompts_climb_the_layers_beside_streams_and_give_the_reference_tokens(five_layers: Path, overlap: bool,
                                                                              layers_preferred: None) -> None:
    """Under a target no step can meet, a prompt beside the streams after the controller's warm-up goes
    by layer groups, as many as the fit allows; a later prompt waits for the one climbing, but for a
    short one, which goes whole between two groups; one sharing the first prompt's blocks hits them,
    offered once all layers wrote them."""
    runner = make_runner(five_layers, num_blocks=128, block_size=4)
    jobs = _layered_jobs()
    result = _run_exact(runner, five_layers, jobs, overlap)
    spans = [(req, span) for so in result.steps for req, span in so.layer_spans.items()]
    assert {req for req, _ in spans} >= {"long", "later"}
    first_again = next(so.num_scheduled_tokens["again"] for so in result.steps if "again" in so.num_scheduled_tokens)
    assert first_again < len(jobs[4].prompt)  # it hit the long prompt's blocks, offered once all layers wrote them
    for req in ("long", "later"):  # each climbed from layer 0 to the last in consecutive spans
        theirs = [span for r, span in spans if r == req]
        assert theirs[0][0] == 0 and theirs[-1][1] == LAYERS
        assert all(a[1] == b[0] for a, b in zip(theirs, theirs[1:]))
    short_step = next(i for i, so in enumerate(result.steps) if so.num_scheduled_tokens.get("short", 0) == 5)
    long_steps = [i for i, so in enumerate(result.steps) if "long" in so.layer_spans]
    assert long_steps[0] < short_step < long_steps[-1]  # the short prompt went whole between two of its groups
    for so in result.steps:  # a layered group has the step's prompt room to itself
        if so.layer_spans:
            (req,) = so.layer_spans
            assert all(n == 1 for r, n in so.num_scheduled_tokens.items() if r != req)
    assert len(runner.layered_hidden) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_short_prompt_whole_beside_a_group_is_exact(five_layers: Path, overlap: bool, layers_preferred: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A short prompt arriving mid-climb goes whole in the same step as a group (one layer beside it,
    forced: the controller sizes it to the room the prompt leaves, tests/core/test_layered_prefill.py),
    its rows through every layer and the climb's through its span, and every output is the reference."""
    monkeypatch.setattr(BudgetController, "layer_group_beside", lambda *args: 1)
    runner = make_runner(five_layers, num_blocks=128, block_size=4)
    result = _run_exact(runner, five_layers, _layered_jobs(), overlap)
    short_step = next(so for so in result.steps if so.num_scheduled_tokens.get("short", 0) == 5)
    assert "long" in short_step.layer_spans  # rode beside one of its groups
    assert len(runner.layered_hidden) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_climbs_stopped_for_an_overrun_go_on_in_token_chunks_and_are_exact(five_layers: Path, overlap: bool,
                                                                          layers_started: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a target no step can meet, a measured layer overruns the room: each climb stops at its first
    measured group and its prompt goes on in token chunks, and every output is the reference. (A layer is
    priced at a second once measured: on this tiny model a group's time is within the fit's error of its
    decodes', and a layer measured at nothing is priced by the fit, which may fit the prompt's share.)"""
    measured = LayerPrice.per_layer_s
    monkeypatch.setattr(LayerPrice, "per_layer_s",
                        lambda self, key, n: None if measured(self, key, n) is None else 1.0)
    runner = make_runner(five_layers, num_blocks=128, block_size=4)
    jobs = _layered_jobs()
    result = _run_exact(runner, five_layers, jobs, overlap)
    long_steps = [so for so in result.steps if "long" in so.num_scheduled_tokens]
    assert "long" in long_steps[0].layer_spans and long_steps[0].layer_spans["long"][1] < LAYERS
    assert any("long" not in so.layer_spans and so.num_scheduled_tokens["long"] > 1 for so in long_steps)
    assert len(runner.layered_hidden) == 0


def test_a_prompt_preempted_mid_climb_starts_over_and_is_exact(five_layers: Path, layers_preferred: None) -> None:
    """A pool too small for every stream and the long prompt: the climbing prompt is preempted (its
    layers so far lost with its blocks), comes back, climbs again, and every output is the reference."""
    runner = make_runner(five_layers, num_blocks=57, block_size=4)
    jobs = [Job(f"s{i}", [(3 * t + i) % 250 + 1 for t in range(20)], 40) for i in range(3)]
    jobs.append(Job("long", [(7 * t + 5) % 250 + 1 for t in range(90)], 4, arrive_step=23))
    result = run_jobs(runner, jobs, num_blocks=57, budget=256, max_model_len=160,
                      scheduler_overrides={"target_itl_ms": 0.001, "num_layers": LAYERS})
    for job in jobs:
        assert result.outputs[job.req_id] == reference_greedy(five_layers, job.prompt, job.max_tokens), job.req_id
    preempted_at = next(so.step_id for so in result.steps if "long" in so.preempted_req_ids)
    climbed = [so.layer_spans["long"] for so in result.steps if so.step_id < preempted_at and "long" in so.layer_spans]
    assert climbed and climbed[-1][1] < LAYERS  # preempted mid-climb
    assert len(runner.layered_hidden) == 0


def test_a_climb_stopped_midway_goes_on_in_token_chunks_and_is_exact(five_layers: Path) -> None:
    """Two of five layers by groups, then the scheduler stops the climb (a layer overran the room): the
    prompt's token chunks start over at its first token, through every layer, and the worker drops
    the residual stream no group continues."""
    runner = make_runner(five_layers, num_blocks=64, block_size=4)
    prompt = [5, 17, 99, 23, 42, 7, 8, 150, 61, 3, 77]
    want = reference_greedy(five_layers, prompt, 1)
    new = [NewRequestData("p", prompt, greedy(1), [10, 11, 12], 0)]
    assert runner.execute_model(step(0, {"p": 11}, new, spans={"p": (0, 2)})).sampled_token_ids == [[]]
    assert len(runner.layered_hidden) == 1
    out = runner.execute_model(step(1, {"p": 6}, cached=[CachedRequestData("p", [], 0)]))
    assert out.sampled_token_ids == [[]] and len(runner.layered_hidden) == 0
    out = runner.execute_model(step(2, {"p": 5}, cached=[CachedRequestData("p", [], 6)]))
    assert out.sampled_token_ids == [want]
