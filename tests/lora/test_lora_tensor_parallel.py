"""Tensor parallel 2 (gloo) with LoRA adapters produces exactly what tensor parallel 1 and peft do:
A and B are split as the base weights are (column-parallel: B's rows; row-parallel: A's columns)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from evenflow.protocol import ModelRunnerOutput, WorkerConfig
from evenflow.protocol.lora import LoRAConfig
from tests.lora.test_lora_reference import check_against_peft, lora_jobs, run
from tests.worker.test_runner_correctness import make_prompt
from tests.ports import free_port
from tests.worker.test_tensor_parallel import REPO

pytestmark = pytest.mark.slow


def test_tp2_with_adapters_equals_tp1_and_peft(tiny_llama: Path, lora_adapters: dict[str, Path],
                                               tmp_path: Path) -> None:
    names = ["all", None, "attn", "mlp", "all"]
    jobs = lora_jobs(lora_adapters, names, [make_prompt(60 + i, 5 + 6 * i) for i in range(5)])
    result = run(tiny_llama, jobs, num_blocks=64, budget=16, max_loras=3, overlap=False)
    check_against_peft(tiny_llama, lora_adapters, jobs, result)
    steps_file, out_file = tmp_path / "steps.msgpack", tmp_path / "rank0.msgpack"
    steps_file.write_bytes(msgspec.msgpack.encode(result.steps))
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in range(2):
            cfg = WorkerConfig(model=str(tiny_llama), rank=rank, world_size=2, dtype="float32", device="cpu",
                               block_size=8, max_model_len=512, num_kv_blocks=64, max_num_seqs=8,
                               dist_init_addr=addr, num_threads=1, lora_config=LoRAConfig(3, 8, 3))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.worker.tp_rank", msgspec.json.encode(cfg).decode(), str(steps_file),
                 str(out_file)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}))
        for p in procs:
            assert p.wait(timeout=240) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tp2: dict[str, list[int]] = {j.req_id: [] for j in jobs}
    for out in msgspec.msgpack.decode(out_file.read_bytes(), type=list[ModelRunnerOutput]):
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids):
            tp2[req_id].extend(toks)
    assert tp2 == result.outputs
