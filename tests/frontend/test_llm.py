"""Offline LLM: engine-core in the background, batches in order, n samples, stop strings, shutdown by PID."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from evenflow.frontend import LLM, SamplingParams
from evenflow.frontend.llm import engine_args_to_flags

def test_engine_args_become_flags() -> None:
    assert engine_args_to_flags({"max_num_batched_tokens": 64, "no_async_scheduling": True, "dtype": "float32",
                                 "seed": None, "enable_lora": False}) == ["--max-num-batched-tokens", "64",
                                                                          "--no-async-scheduling", "--dtype",
                                                                          "float32", "--no-enable-lora"]


def test_switches_given_as_false_reach_the_engine_as_vllm_users_write_them() -> None:
    """``LLM(enable_prefix_caching=False)`` turns the cache off (it was dropped as "not given"), and
    every engine-core switch takes True and False."""
    from evenflow.core.engine_config import build_parser

    parser = build_parser()
    off = parser.parse_args(["--model", "m", *engine_args_to_flags({"enable_prefix_caching": False,
                                                                     "async_scheduling": False})])
    assert off.enable_prefix_caching is False and off.async_scheduling is False
    on = parser.parse_args(["--model", "m", *engine_args_to_flags({"enable_prefix_caching": True, "async_scheduling": None,
                                                                    "enable_lora": True, "allow_remote": False,
                                                                    "headless": False})])
    assert on.enable_prefix_caching and on.async_scheduling and on.enable_lora
    assert not on.allow_remote and not on.headless
    switches = [a for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)]
    plain = [a.option_strings for a in parser._actions if a.nargs == 0 and a.dest != "help"
             and not isinstance(a, argparse.BooleanOptionalAction)]
    assert len(switches) >= 5 and plain == [], plain  # no store_true switch that False could not reach


@pytest.mark.slow
def test_generate_chat_and_shutdown(demo_model_dir: Path) -> None:
    llm = LLM(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=128, max_num_seqs=32)
    pid = llm._proc.pid  # type: ignore[union-attr]
    try:
        prompts = [f"def f{i}(x):" for i in range(10)]
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert len(outs) == 10
        assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
        assert all(o.prompt == p and o.text == llm.tokenizer.decode(o.token_ids) for o, p in zip(outs, prompts))
        # Order is the prompts' order: the same prompt alone gives the same greedy text.
        assert llm.generate(prompts[3], greedy)[0].text == outs[3].text
        ids = llm.tokenizer.encode(prompts[3])
        assert llm.generate([ids], greedy)[0].token_ids == outs[3].token_ids

        many = llm.generate("import", SamplingParams(max_tokens=5, n=3, seed=0))[0]
        assert len(many.outputs) == 3 and [o.index for o in many.outputs] == [0, 1, 2]

        stop = outs[0].text[2:5]
        stopped = llm.generate(prompts[0], SamplingParams(max_tokens=6, temperature=0.0, stop=[stop]))[0]
        assert stopped.text == outs[0].text[:outs[0].text.index(stop)] and stopped.finish_reason == "stop"

        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(chat) == 1 and len(chat[0].token_ids) == 4
    finally:
        llm.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_in_process_llm_runs_the_engine_and_the_model_in_this_process(demo_model_dir: Path) -> None:
    """``in_process=True``: no child process; the engine loop on a thread here, the model runner
    here, and the greedy tokens transformers gives (float32), through the same client path."""
    import threading

    from evenflow.worker.runner import ModelRunner
    from tests.checkpoints import reference_greedy

    llm = LLM(model=str(demo_model_dir), in_process=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=128, max_num_seqs=8)
    try:
        assert llm._proc is None
        assert any(t.name == "evenflow-engine-core" for t in threading.enumerate())
        assert isinstance(llm._in_process.engine.executor.runner, ModelRunner)
        prompts = [llm.tokenizer.encode(f"def f{i}(x):") for i in range(3)]
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == [reference_greedy(demo_model_dir, p, 6) for p in prompts]
        engine_thread = next(t for t in threading.enumerate() if t.name == "evenflow-engine-core")
    finally:
        llm.shutdown()
    engine_thread.join(timeout=5)
    assert not engine_thread.is_alive()


@pytest.mark.slow
def test_prompt_logprobs_offline_as_vllm(demo_model_dir: Path) -> None:
    """``RequestOutput.prompt_logprobs``: None, then {token_id: Logprob} per prompt token, the prompt
    token and the top 2, equal to transformers' log_softmax (float32), at a budget of 8 tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(demo_model_dir), in_process=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=8, max_num_seqs=4)
    try:
        ids = llm.tokenizer.encode("def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")
        assert len(ids) > 3 * 8
        out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2), use_tqdm=False)[0]
        plain = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids
    model = AutoModelForCausalLM.from_pretrained(str(demo_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        assert entry is not None and list(entry)[0] == ids[i + 1] and len(entry) in (2, 3)
        top = torch.topk(expected[i], 2).indices.tolist()
        assert [entry[t].rank for t in top] == [1, 2]  # the top 2, ranked
        for token_id, lp in entry.items():
            assert abs(lp.logprob - expected[i, token_id].item()) < 1e-4
            assert lp.decoded_token == llm.tokenizer.token_string(token_id)
        assert entry[ids[i + 1]].rank == int((expected[i] > expected[i, ids[i + 1]]).sum()) + 1
