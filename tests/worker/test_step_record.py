"""A worker's recorded steps replay into a runner alone: the same steps, the same tokens, and a
comparison of their times by kind of step."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from evenflow.bench.step_replay import compare, format_comparison, replay
from evenflow.protocol import CachedRequestData, InitKVCache, NewRequestData, SchedulerOutput, WorkerShutdown
from evenflow.worker.runner import ModelRunner
from evenflow.worker.step_record import RECORD_ENV, StepClock, StepRecorder, read_steps
from tests.worker.harness import greedy, make_runner


def test_a_recording_replays_the_same_steps_and_tokens(tiny_llama: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(tiny_llama, num_blocks=32, block_size=4)
    prefix = tmp_path / "run"
    monkeypatch.setenv(RECORD_ENV, str(prefix))
    recorder = StepRecorder.from_env(runner.config)
    assert recorder is not None
    encode = msgspec.msgpack.Encoder().encode
    prompts = {"a": [5, 17, 99, 23, 42, 7], "b": [8, 150, 61, 3, 9, 11, 12, 13, 14]}
    steps = [
        SchedulerOutput(0, [NewRequestData("a", prompts["a"], greedy(4), [0, 1], 0),
                            NewRequestData("b", prompts["b"], greedy(4), [2, 3, 4], 0)],
                        [], {"a": 6, "b": 5}, 11),  # b's prompt in two chunks
        SchedulerOutput(1, [], [CachedRequestData("a", [], 6), CachedRequestData("b", [], 5)], {"a": 1, "b": 4}, 5),
        SchedulerOutput(2, [], [CachedRequestData("a", [], 7), CachedRequestData("b", [], 9)], {"a": 1, "b": 1}, 2),
    ]
    recorder.frame(encode(InitKVCache(32)))
    served_tokens = []
    for so in steps:
        recorder.frame(encode(so))
        clock = StepClock()
        out = runner.execute_model(so)
        recorder.step(clock.stop(so))
        served_tokens.append(out.sampled_token_ids)
    recorder.frame(encode(WorkerShutdown()))
    recorder.close()

    served = read_steps(Path(f"{prefix}.steps.jsonl"))
    assert [t.step_id for t in served] == [0, 1, 2]
    assert [t.kind for t in served] == ["with a prompt chunk", "with a prompt chunk", "decode-only"]
    assert all(t.wall_s > 0 and t.threads >= 1 for t in served)
    replayed = replay(prefix)
    assert [t.step_id for t in replayed.timings] == [0, 1, 2]
    assert [o.sampled_token_ids for o in replayed.outputs] == served_tokens
    rows = compare(served, replayed.timings)
    assert {r.kind: r.steps for r in rows} == {"with a prompt chunk": 2, "decode-only": 1}
    assert all(r.served_ms > 0 and r.replayed_ms > 0 for r in rows)
    assert "| decode-only | 1 |" in format_comparison(rows)


def test_no_recording_unless_asked(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORD_ENV, raising=False)
    runner: ModelRunner = make_runner(tiny_llama, num_blocks=8, block_size=4)
    assert StepRecorder.from_env(runner.config) is None
    monkeypatch.setenv(RECORD_ENV, "/nonexistent/never-written")
    other_rank = msgspec.structs.replace(runner.config, rank=1)
    assert StepRecorder.from_env(other_rank) is None  # rank 0 records for all
