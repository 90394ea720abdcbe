"""A worker's recorded steps replay into a runner alone: the same steps, the same tokens, and a
comparison of their times by kind of step; a recording cut short replays up to its cut; a recording's time
accounted by what its steps carried (scripts/account_steps.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from evenflow.bench.step_account import account, format_account, kind_of, prompt_tokens
from evenflow.bench.step_replay import compare, format_comparison, replay
from evenflow.protocol import CachedRequestData, InitKVCache, NewRequestData, SchedulerOutput, WorkerShutdown
from evenflow.worker.step_record import RECORD_ENV, StepClock, StepRecorder, StepTiming, read_frames, read_steps
from tests.worker.harness import greedy, make_runner

PROMPTS = {"a": [5, 17, 99, 23, 42, 7], "b": [8, 150, 61, 3, 9, 11, 12, 13, 14]}
STEPS = [
    SchedulerOutput(0, [NewRequestData("a", PROMPTS["a"], greedy(4), [0, 1], 0),
                        NewRequestData("b", PROMPTS["b"], greedy(4), [2, 3, 4], 0)],
                    [], {"a": 6, "b": 5}, 11),  # b's prompt in two chunks
    SchedulerOutput(1, [], [CachedRequestData("a", [], 6), CachedRequestData("b", [], 5)], {"a": 1, "b": 4}, 5),
    SchedulerOutput(2, [], [CachedRequestData("a", [], 7), CachedRequestData("b", [], 9)], {"a": 1, "b": 1}, 2),
]


def record(tiny_llama: Path, prefix: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """Run STEPS through a runner with a recorder, as the worker process does; the sampled tokens."""
    runner = make_runner(tiny_llama, num_blocks=32, block_size=4)
    monkeypatch.setenv(RECORD_ENV, str(prefix))
    recorder = StepRecorder.from_env(runner.config)
    assert recorder is not None
    encode = msgspec.msgpack.Encoder().encode
    recorder.frame(encode(InitKVCache(32)))
    tokens = []
    for so in STEPS:
        recorder.frame(encode(so))
        clock = StepClock()
        out = runner.execute_model(so)
        recorder.step(clock.stop(so))
        assert out is not None
        tokens.append(out.sampled_token_ids)
    recorder.frame(encode(WorkerShutdown()))
    recorder.close()
    return tokens


def test_a_recording_replays_the_same_steps_and_tokens(tiny_llama: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = tmp_path / "run"
    served_tokens = record(tiny_llama, prefix, monkeypatch)
    served = read_steps(prefix)
    assert [t.step_id for t in served] == [0, 1, 2]
    assert [t.kind for t in served] == ["with a prompt chunk", "with a prompt chunk", "decode-only"]
    assert all(t.wall_s > 0 and t.cpu_s >= 0 and t.threads >= 1 for t in served)
    replayed = replay(prefix)
    assert [t.step_id for t in replayed.timings] == [0, 1, 2]
    assert [o.sampled_token_ids if o is not None else None for o in replayed.outputs] == served_tokens
    rows = compare(served, replayed.timings)
    assert {r.kind: r.steps for r in rows} == {"with a prompt chunk": 2, "decode-only": 1}
    assert all(r.served_ms > 0 and r.replayed_ms > 0 and r.ratio > 0 for r in rows)
    assert "| decode-only | 1 |" in format_comparison(rows)
    # A second engine-core recording to the same prefix does not overwrite the first: it adds its pid.
    assert record(tiny_llama, prefix, monkeypatch) == served_tokens
    assert {p.name for p in tmp_path.glob("*.config.json")} == {"run.config.json", f"run.{os.getpid()}.config.json"}
    assert [t.step_id for t in read_steps(prefix)] == [0, 1, 2]


def test_a_recording_cut_short_replays_up_to_the_cut(tiny_llama: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = tmp_path / "run"
    served_tokens = record(tiny_llama, prefix, monkeypatch)
    frames = Path(f"{prefix}.frames")
    whole = list(read_frames(prefix))
    # Cut inside the last step's message (the shutdown and 3 bytes of the step before it gone).
    frames.write_bytes(frames.read_bytes()[: -(4 + len(whole[-1])) - 3])
    steps = Path(f"{prefix}.steps.jsonl")
    steps.write_bytes(steps.read_bytes()[:-5])  # the last line unfinished
    assert len(list(read_frames(prefix))) == len(whole) - 2
    assert [t.step_id for t in read_steps(prefix)] == [0, 1]
    replayed = replay(prefix)
    assert [o.sampled_token_ids if o is not None else None for o in replayed.outputs] == served_tokens[:2]


def test_steps_are_told_apart_by_kind_without_drafts_and_by_thread_count() -> None:
    so = SchedulerOutput(7, [], [], {"a": 3, "b": 1}, 4, num_draft_slots={"a": 2})
    clock = StepClock()
    assert clock.stop(so).kind == "decode-only"  # a's 3 tokens are 1 decode and 2 drafts
    assert clock.stop(SchedulerOutput(8, [], [], {}, 0)).kind == "empty"

    def timing(step: int, tokens: int, threads: int, wall: float, contended: bool = False) -> StepTiming:
        return StepTiming(step, tokens, tokens, wall, 2 * wall, 0, threads, contended)

    served = [timing(0, 5, 2, 0.2), timing(1, 1, 1, 0.1), timing(2, 1, 2, 0.05), timing(3, 0, 2, 0.0),
              timing(4, 5, 2, 0.9, contended=True)]
    replayed = [timing(0, 5, 2, 0.1), timing(1, 1, 2, 0.05), timing(2, 1, 2, 0.04), timing(3, 0, 2, 0.0),
                timing(4, 5, 2, 0.1)]
    rows = {r.kind: r for r in compare(served, replayed)}
    assert set(rows) == {"with a prompt chunk", "decode-only", "decode-only, 1 / 2 threads",
                         "with a prompt chunk, contended"}
    assert clock.stop(so, contended=True).contended
    assert rows["with a prompt chunk"].ratio == pytest.approx(2.0)
    assert rows["decode-only"].served_ms == pytest.approx(50) and rows["decode-only"].served_cpu_per_wall == 2


def test_no_recording_unless_asked_nor_of_a_tensor_parallel_rank(tiny_llama: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORD_ENV, raising=False)
    runner = make_runner(tiny_llama, num_blocks=8, block_size=4)
    assert StepRecorder.from_env(runner.config) is None
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "tp"))
    assert StepRecorder.from_env(msgspec.structs.replace(runner.config, world_size=2)) is None
    assert list(tmp_path.iterdir()) == []


def test_a_recording_is_accounted_by_what_its_steps_carried(tiny_llama: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = tmp_path / "run"
    record(tiny_llama, prefix, monkeypatch)
    rows = {r.kind: r for r in account(prefix, long_tokens=len(PROMPTS["a"]))}  # b's 9-token prompt is the long one
    assert {k: (r.steps, r.decode_tokens, r.prompt_tokens) for k, r in rows.items()} == {
        "long chunk + 1 short": (1, 0, 11), "long chunk": (1, 1, 4), "decode only": (1, 2, 0)}
    served = {t.step_id: t.wall_s for t in read_steps(prefix)}
    assert rows["decode only"].seconds == served[2]
    assert "| all | 3 |" in format_account(list(rows.values()))
    script = Path(__file__).parents[2] / "scripts" / "account_steps.py"
    printed = subprocess.run([sys.executable, str(script), str(prefix), "--long-tokens", "6"], capture_output=True,
                             text=True, timeout=120, check=True).stdout
    assert "| long chunk + 1 short | 1 |" in printed and "| all | 3 |" in printed
    # A layer group of the long prompt, and three short prompts beside it.
    group = SchedulerOutput(3, [], [], {"b": 9, "c": 4, "d": 4, "e": 4, "a": 1}, 21, layer_spans={"b": (0, 1)})
    assert kind_of(group, {"b": 9, "c": 4, "d": 4, "e": 4}, long_tokens=6) == "long layers + 3+ short"


def test_a_prompts_last_token_is_prompt_work_and_a_decode_with_drafts_is_not() -> None:
    # b has 8 of its 9 prompt tokens computed: its one token this step is the prompt's last. a decodes
    # with two draft slots (3 tokens scheduled).
    so = SchedulerOutput(4, [], [CachedRequestData("a", [], 7), CachedRequestData("b", [], 8)], {"a": 3, "b": 1}, 4,
                         num_draft_slots={"a": 2})
    assert prompt_tokens(so, {"a": 6, "b": 9}) == {"a": 0, "b": 1}
    assert kind_of(so, {"a": 6, "b": 9}, long_tokens=6) == "long chunk"
    assert kind_of(so, {"a": 6, "b": 9}, long_tokens=20) == "1 short"
