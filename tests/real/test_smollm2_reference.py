"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32) in the real runner,
driven by the real scheduler, against transformers loading the same GGUF: greedy token ids equal
at the default budget and at budgets that cut the chat prompts mid-way, with overlap on and off,
prompts prefilled by layer groups, a chunk beside a short prompt, prefix-cache hits, preemption, n-gram
drafts and a JSON-schema grammar;
logprobs within 2e-3."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from evenflow.core.sched.budget_controller import BudgetController
from evenflow.core.sched.layered_prefill import LayerPrice
from evenflow.core.sched.structured_output import StructuredOutputManager
from evenflow.frontend.chat_template import render_chat
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import SamplingParams, SpeculativeConfig, StructuredOutputsParams
from evenflow.protocol.gguf_tokenizer import tokenizer_json_text
from evenflow.protocol.structured_outputs import to_grammar
from evenflow.worker.runner import ModelRunner
from tests.worker.harness import Job, make_runner, run_jobs

EOS = 2  # <|im_end|>
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Explain in one sentence why the sky is blue."]
# Shared by every prompt (so prefix caching has blocks to share) and long enough that the prompts
# (~80 tokens) are cut by both small budgets.
SYSTEM = ("You are a terse assistant running on a small laptop. Answer every question in at most ten words, "
          "without lists, without greetings, and without repeating the question back to the user. Prefer plain "
          "words that a child would understand, and never apologise.")
# Real logits differ from transformers' by kernel rounding only (float32 both); 2e-3 in log space.
LOGPROB_TOLERANCE = 2e-3
# The first test also waits for the model loads of its fixtures (runner and transformers); on a
# shared 2-core machine that alone can pass the suite's 300 s default.
pytestmark = pytest.mark.timeout(900)
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def chat_ids(tok: Tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return tok.encode(render_chat(tok.chat_template, messages, True, tok.bos_token, tok.eos_token),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def runner(smollm2_gguf: Path) -> ModelRunner:
    return make_runner(smollm2_gguf, num_blocks=64, block_size=16, max_model_len=512)


@pytest.fixture(scope="module")
def reference(hf_model: Any) -> Callable[[list[int], int], list[int]]:
    @lru_cache(maxsize=None)
    def greedy(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=EOS)
        return out[0, len(prompt):].tolist()

    return lambda prompt, max_tokens: greedy(tuple(prompt), max_tokens)


def expect(reference: Callable[[list[int], int], list[int]], jobs: list[Job]) -> dict[str, list[int]]:
    return {j.req_id: reference(j.prompt, j.max_tokens) for j in jobs}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [2048, 64, 17])
def test_greedy_equals_transformers(runner: ModelRunner, smollm2_tokenizer: Tokenizer, reference: Any,
                                    budget: int, overlap: bool) -> None:
    jobs = [Job(f"q{i}-{budget}-{overlap}", chat_ids(smollm2_tokenizer, q), 12, arrive_step=2 * i)
            for i, q in enumerate(QUESTIONS)]
    assert all(len(j.prompt) > 64 for j in jobs)  # both small budgets cut every prompt mid-way
    result = run_jobs(runner, jobs, num_blocks=64, budget=budget, overlap=overlap)
    assert max(s.total_num_scheduled_tokens for s in result.steps) <= budget
    assert result.outputs == expect(reference, jobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompts_by_layer_groups_beside_a_stream(runner: ModelRunner, smollm2_tokenizer: Tokenizer, reference: Any,
                                                 overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a target no step meets, the later prompts (each after the shared system prompt's cached
    blocks) climb the 30 layers a group a step beside the decoding stream (the controller's choice of
    groups over chunks forced, and every layer priced as never measured, so each group probes one layer
    whatever this machine's timings: tests/core/test_layered_prefill.py tests the pricing)."""
    monkeypatch.setattr(BudgetController, "prefers_layers", lambda *args: True)
    monkeypatch.setattr(LayerPrice, "per_layer_s", lambda *args: None)
    # One prompt climbs at a time, one layer a step: the second arrives after the first's 30 steps, while
    # the first stream still decodes.
    jobs = [Job(f"lay-{i}-{overlap}", chat_ids(smollm2_tokenizer, q), 96 if i == 0 else 8, arrive_step=arrive)
            for (i, q), arrive in zip(enumerate(QUESTIONS), (0, 12, 52))]
    result = run_jobs(runner, jobs, num_blocks=64, budget=2048, overlap=overlap,
                      scheduler_overrides={"target_itl_ms": 0.001, "num_layers": 30})
    climbed = {req for s in result.steps for req in s.layer_spans}
    assert climbed == {jobs[1].req_id, jobs[2].req_id}
    assert result.outputs == expect(reference, jobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunk_beside_a_short_prompt(runner: ModelRunner, smollm2_tokenizer: Tokenizer, reference: Any,
                                       overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat prompt in 24-token chunks beside a decoding stream (the allowance forced); a short prompt
    arriving behind it goes whole, and the chunk rides beside it in the room it leaves."""
    allowance = 24
    monkeypatch.setattr(BudgetController, "prefill_allowance",
                        lambda self, survey: allowance if survey.decodes else 4096)
    short = smollm2_tokenizer.encode("The sky is", add_special_tokens=False)
    jobs = [Job(f"bes-stream-{overlap}", chat_ids(smollm2_tokenizer, QUESTIONS[0]), 24),
            Job(f"bes-long-{overlap}", chat_ids(smollm2_tokenizer, QUESTIONS[2], "Be exact. " + SYSTEM), 8,
                arrive_step=3),
            Job(f"bes-short-{overlap}", short, 8, arrive_step=5)]
    result = run_jobs(runner, jobs, num_blocks=64, budget=2048, overlap=overlap,
                      scheduler_overrides={"target_itl_ms": 50.0})
    beside = next(s for s in result.steps if s.num_scheduled_tokens.get(jobs[2].req_id, 0) > 1)
    assert beside.num_scheduled_tokens[jobs[2].req_id] == len(short)  # whole
    assert beside.num_scheduled_tokens[jobs[1].req_id] == allowance - len(short)  # the chunk in what it left
    assert result.outputs == expect(reference, jobs)


def test_prefix_hit_on_the_shared_system_prompt(runner: ModelRunner, smollm2_tokenizer: Tokenizer,
                                                reference: Any) -> None:
    first = Job("sys-first", chat_ids(smollm2_tokenizer, QUESTIONS[0]), 10)
    second = Job("sys-second", chat_ids(smollm2_tokenizer, QUESTIONS[1]), 10, arrive_step=6)
    result = run_jobs(runner, [first, second], num_blocks=64, budget=64)
    new_second = next(r for s in result.steps for r in s.scheduled_new_reqs if r.req_id == "sys-second")
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt, second.prompt)) if a != b)
    assert new_second.num_computed_tokens == shared // 16 * 16 > 0  # every full shared block came from the cache
    assert result.outputs == expect(reference, [first, second])


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption(runner: ModelRunner, smollm2_tokenizer: Tokenizer, reference: Any, overlap: bool) -> None:
    jobs = [Job(f"pre-{i}-{overlap}", chat_ids(smollm2_tokenizer, q), 24) for i, q in enumerate(QUESTIONS)]
    # 10 blocks of 16 tokens cannot hold three requests growing to ~105 tokens each (4 shared blocks).
    result = run_jobs(runner, jobs, num_blocks=10, budget=64, overlap=overlap, max_model_len=160)
    assert result.num_preemptions > 0
    assert result.outputs == expect(reference, jobs)


def test_ngram_drafts(smollm2_gguf: Path, smollm2_tokenizer: Tokenizer, reference: Any) -> None:
    spec = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4, disable_by_batch_size=None)
    spec_runner = make_runner(smollm2_gguf, num_blocks=64, block_size=16, max_model_len=512, speculative_config=spec)
    text = "The quick brown fox jumps over the lazy dog near the river bank at dawn."
    jobs = [Job("copy", chat_ids(smollm2_tokenizer, f"Repeat this sentence exactly: {text}"), 20),
            Job("free", chat_ids(smollm2_tokenizer, QUESTIONS[2]), 12, arrive_step=1)]
    result = run_jobs(spec_runner, jobs, num_blocks=64, budget=64)
    assert result.num_accepted_drafts > 0
    assert result.outputs == expect(reference, jobs)


def test_json_schema_grammar(runner: ModelRunner, smollm2_gguf: Path, smollm2_tokenizer: Tokenizer,
                             hf_model: Any) -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    so = StructuredOutputsParams(json=json.dumps(PERSON_SCHEMA))
    prompt = chat_ids(smollm2_tokenizer, "Give me a JSON object describing a person called Ada, aged 36.")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=so)
    grammars = StructuredOutputManager(smollm2_gguf, 49152, [EOS])
    try:
        result = run_jobs(runner, [Job("json", prompt, 30, params=params, eos_token_ids=(EOS,))], num_blocks=64,
                          budget=64, structured_output=grammars)
    finally:
        grammars.shutdown()
    # The reference: transformers greedy under the same llguidance constraint.
    ll_tok = llguidance.LLTokenizer(tokenizer_json_text(smollm2_gguf), n_vocab=49152, eos_token=[EOS])
    matcher = llguidance.LLMatcher(ll_tok, to_grammar(*so.kind_and_spec()))  # type: ignore[misc]
    bitmask = allocate_token_bitmask(1, 49152)
    expected: list[int] = []
    step_input, past = torch.tensor([prompt]), None
    while len(expected) < 30 and (not expected or expected[-1] != EOS):
        fill_next_token_bitmask(matcher, bitmask)
        allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:49152].astype(bool)
        with torch.no_grad():
            out = hf_model(step_input, past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1], out.past_key_values
        logits[torch.from_numpy(~allowed)] = float("-inf")
        expected.append(int(logits.argmax()))
        matcher.consume_token(expected[-1])
        step_input = torch.tensor([[expected[-1]]])
    assert result.outputs["json"] == expected
    parsed = json.loads(smollm2_tokenizer.decode(expected))
    assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int)


def test_logprobs_within_tolerance(runner: ModelRunner, smollm2_tokenizer: Tokenizer, hf_model: Any) -> None:
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    result = run_jobs(runner, [Job("lp", prompt, 8, params=params)], num_blocks=64, budget=64)
    tokens = result.outputs["lp"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.double(), dim=-1)
    for pos, lp in enumerate(result.logprobs["lp"]):
        assert lp.token_ids[0] == tokens[pos] and lp.sampled_rank == 1
        top = torch.topk(expected[pos], 3).indices.tolist()
        assert lp.token_ids[1:] == top
        want = expected[pos, lp.token_ids].numpy()
        assert np.abs(np.array(lp.logprobs) - want).max() < LOGPROB_TOLERANCE
