"""ModelRunner API details: output alignment with logprobs, seeded sampling, empty steps,
KV-cache sizing, dtype resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from evenflow.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, WorkerConfig
from evenflow.worker.kv_cache import bytes_per_block
from evenflow.worker.loader import resolve_dtype
from evenflow.worker.runner import ModelRunner

from tests.worker.harness import greedy, make_runner


def test_outputs_align_with_logprobs_and_partial_chunks(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, num_blocks=32, block_size=4)
    lp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    so = SchedulerOutput(0, [NewRequestData("long", list(range(3, 23)), greedy(4), [0, 1, 2, 3, 4], 0),
                             NewRequestData("lp", [5, 6, 7], lp, [10], 0),
                             NewRequestData("one", [9], greedy(4), [11], 0)],
                         [], {"long": 8, "lp": 3, "one": 1}, 12)
    out = runner.execute_model(so)
    by_id = dict(zip(out.req_ids, out.sampled_token_ids))
    assert by_id["long"] == [] and len(by_id["lp"]) == 1 and len(by_id["one"]) == 1
    assert out.logprobs is not None and len(out.logprobs) == 3
    lps = dict(zip(out.req_ids, out.logprobs))
    assert lps["long"] is None and lps["one"] is None
    assert len(lps["lp"]) == 1  # one TokenLogprobs per sampled token
    assert lps["lp"][0].token_ids[0] == by_id["lp"][0] and len(lps["lp"][0].token_ids) == 4
    assert out.forward_s > 0 and out.prepare_s > 0
    # An empty step only updates state.
    empty = runner.execute_model(SchedulerOutput(1, [], [], {}, 0, finished_req_ids=["one"]))
    assert empty.req_ids == [] and "one" not in runner.batch.requests
    # num_computed_tokens is authoritative: continue "long" from 8.
    out = runner.execute_model(SchedulerOutput(2, [], [CachedRequestData("long", [], 8)], {"long": 12}, 12))
    assert len(out.sampled_token_ids[0]) == 1


def test_seeded_sampling_is_reproducible(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    runs = []
    for attempt in range(2):
        runner = make_runner(tiny_llama, num_blocks=16, block_size=8)
        prompt = [4, 8, 15, 16, 23, 42]
        out = runner.execute_model(SchedulerOutput(0, [NewRequestData("s", prompt, params, [0], 0)], [],
                                                   {"s": 6}, 6))
        tokens = out.sampled_token_ids[0]
        for i in range(5):
            blocks = [1] if len(prompt) + len(tokens) - 1 == 8 else []
            out = runner.execute_model(SchedulerOutput(i + 1, [], [CachedRequestData("s", blocks, 5 + len(tokens))],
                                                       {"s": 1}, 1))
            tokens += out.sampled_token_ids[0]
        runs.append(tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_kv_sizing_from_memory_and_override(tiny_llama: Path) -> None:
    cfg = WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu", block_size=16,
                       kv_cache_memory=1 << 20, max_model_len=128)
    runner = ModelRunner(cfg)
    per_block = bytes_per_block(2, 16, 2, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.determine_num_kv_blocks() == (1 << 20) // per_block
    runner.profile_forward()  # the CUDA sizing pass also runs on CPU
    runner.init_kv_cache(7)
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (7, 16, 2, 16) and len(runner.kv_caches) == 2
    assert runner.attention_backend == "torch" and runner.device == torch.device("cpu")


def test_dtype_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", "bfloat16", cpu) == torch.float32
    assert resolve_dtype("bfloat16", "float32", cpu) == torch.bfloat16
    assert resolve_dtype("auto", "float32", cpu) == torch.float32
    assert resolve_dtype("auto", "float16", cpu) in (torch.float16, torch.float32)
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "float32", cpu)
