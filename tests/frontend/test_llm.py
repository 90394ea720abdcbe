"""Offline LLM: engine-core in the background, batches in order, n samples, stop strings, shutdown by PID."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evenflow.frontend import LLM, SamplingParams
from evenflow.frontend.llm import engine_args_to_flags

def test_engine_args_become_flags() -> None:
    assert engine_args_to_flags({"max_num_batched_tokens": 64, "no_async_scheduling": True, "dtype": "float32",
                                 "seed": None, "x": False}) == ["--max-num-batched-tokens", "64",
                                                               "--no-async-scheduling", "--dtype", "float32"]


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
