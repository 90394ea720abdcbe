"""Tensor parallel 2 (gloo, two processes) produces exactly what tensor parallel 1 does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from evenflow.protocol import ModelRunnerOutput, SpeculativeConfig, WorkerConfig

from tests.worker.harness import Job, make_runner, run_jobs
from tests.worker.test_runner_correctness import make_prompt
from tests.worker.test_spec_decode_greedy import copy_prompt
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3,
                                                                disable_by_batch_size=None)])
def test_tp2_equals_tp1(tiny_llama: Path, tmp_path: Path, spec: SpeculativeConfig | None) -> None:
    # TP 1 with the real scheduler, recording its steps (chunked prefill, mixed decode/prefill).
    runner = make_runner(tiny_llama, num_blocks=64, block_size=8, max_num_seqs=8, speculative_config=spec)
    jobs = [Job(f"tp-{n}", make_prompt(n, n), 7, arrive_step=n % 3) for n in (5, 23, 12)]
    if spec is not None:  # its greedy output loops: drafts get accepted (and every rank must agree)
        jobs.append(Job("tp-copy", copy_prompt(2, 12), 24))
    result = run_jobs(runner, jobs, num_blocks=64, budget=16)
    assert spec is None or result.num_accepted_drafts > 0
    steps_file = tmp_path / "steps.msgpack"
    steps_file.write_bytes(msgspec.msgpack.encode(result.steps))
    # The same SchedulerOutputs to two ranks.
    out_file = tmp_path / "rank0.msgpack"
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in range(2):
            cfg = WorkerConfig(model=str(tiny_llama), rank=rank, world_size=2, dtype="float32", device="cpu",
                               block_size=8, max_model_len=512, num_kv_blocks=64, max_num_seqs=8,
                               dist_init_addr=addr, num_threads=1, speculative_config=spec)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.worker.tp_rank", msgspec.json.encode(cfg).decode(), str(steps_file),
                 str(out_file)],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            ))
        for p in procs:
            assert p.wait(timeout=240) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = msgspec.msgpack.decode(out_file.read_bytes(), type=list[ModelRunnerOutput])
    tp2: dict[str, list[int]] = {j.req_id: [] for j in jobs}
    for out in outputs:
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids):
            tp2[req_id].extend(toks)
    assert tp2 == result.outputs
    assert all(len(tp2[j.req_id]) == j.max_tokens for j in jobs)
