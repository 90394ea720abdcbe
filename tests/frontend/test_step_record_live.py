"""EVENFLOW_STEP_RECORD on a real engine: the worker process records every step it ran, and the
replay into a runner alone samples the tokens the engine returned."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from evenflow.bench.step_replay import compare, replay
from evenflow.frontend import LLM, SamplingParams
from evenflow.worker.step_record import RECORD_ENV, read_steps


@pytest.mark.slow
def test_a_served_worker_records_steps_that_replay_to_the_same_tokens(demo_model_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = tmp_path / "rec"
    monkeypatch.setenv(RECORD_ENV, str(prefix))  # the engine-core and its worker inherit it
    with LLM(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        outs = llm.generate([f"def f{i}(x): return x *" for i in range(4)],
                            SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    served = read_steps(prefix)
    assert len(served) >= 8 and {t.kind for t in served} >= {"with a prompt chunk", "decode-only"}
    replayed = replay(prefix)
    assert [t.step_id for t in replayed.timings] == [t.step_id for t in served]
    tokens: dict[str, list[int]] = defaultdict(list)
    for out in replayed.outputs:
        if out is not None:
            for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
                tokens[req_id] += sampled
    assert sorted(tokens.values()) == sorted(list(o.outputs[0].token_ids) for o in outs)
    assert {r.kind for r in compare(served, replayed.timings)} >= {"with a prompt chunk", "decode-only"}
