"""Chunk boundaries with a grammar: the real runner (tiny float32 Llama) and the real scheduler
with its grammar manager, against transformers greedy under the same llguidance constraint.

The tiny model has no tokenizer: a small byte-level BPE is trained here, with ``</s>`` at the
model's EOS id (2). Its ~70 tokens are ids below the model's 256, so unconstrained greedy (ids
3..255) would almost never follow it: every output token here is the mask's doing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from evenflow.core.sched.structured_output import StructuredOutputManager
from evenflow.protocol import SamplingParams, StructuredOutputsParams
from evenflow.protocol.structured_outputs import to_grammar
from tests.checkpoints import _load_reference
from tests.worker.harness import Job, RunResult
from tests.worker.scenarios import References, Runners, Scenario, check, tokens
from tests.worker.test_chunk_boundaries import chunks_of

llguidance = pytest.importorskip("llguidance")

EOS = 2
VOCAB = 256
REGEX = r"(ab|cd)-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMARS = {"regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICES)}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Specials first: </s> gets id 2, the model's EOS. Only the corpus' bytes: < 256 tokens.
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["ab-12 cd-34 yes no alpha beta gamma delta 0123456789"] * 50, trainer=trainer)
    path = tmp_path_factory.mktemp("grammar_tok") / "tokenizer.json"
    tok.save(str(path))
    assert tok.get_vocab_size(True) < VOCAB and tok.token_to_id("</s>") == EOS
    return path


@pytest.fixture(scope="module")
def grammars(tokenizer_file: Path) -> Iterator[StructuredOutputManager]:
    manager = StructuredOutputManager(tokenizer_file, VOCAB, [EOS])
    yield manager
    manager.shutdown()


def constrained_greedy(model_dir: Path, tokenizer_file: Path, so: StructuredOutputsParams
                       ) -> Callable[[list[int], int], list[int]]:
    """Transformers greedy restricted to the grammar's allowed tokens, up to EOS (included)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    ll_tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=VOCAB, eos_token=[EOS])
    kind_spec = so.kind_and_spec()
    assert kind_spec is not None

    def reference(prompt: list[int], max_tokens: int) -> list[int]:
        model = _load_reference(str(model_dir))
        matcher = llguidance.LLMatcher(ll_tokenizer, to_grammar(*kind_spec))
        bitmask = allocate_token_bitmask(1, VOCAB)
        out: list[int] = []
        while len(out) < max_tokens and (not out or out[-1] != EOS):
            fill_next_token_bitmask(matcher, bitmask)
            allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1, :VOCAB]
            logits[torch.from_numpy(~allowed)] = float("-inf")
            out.append(int(logits.argmax()))
            assert matcher.consume_token(out[-1]) or out[-1] == EOS
        return out

    return reference


def decode(tokenizer_file: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).decode(ids)


def assert_masks_only_where_sampling(result: RunResult, req_ids: set[str]) -> None:
    """A grammar request gets a mask row exactly in the steps where it samples."""
    for so, mro in zip(result.steps, result.runner_outputs):
        sampling = {r for r, sampled in zip(mro.req_ids, mro.sampled_token_ids) if sampled}
        assert set(so.structured_output_req_ids) == sampling & req_ids, so.step_id


def assert_follows(tokenizer_file: Path, grammar: str, output: list[int]) -> None:
    assert output[-1] == EOS, output  # the grammar ended, and EOS stopped the request
    text = decode(tokenizer_file, output[:-1])
    assert re.fullmatch(REGEX, text) if grammar == "regex" else text in CHOICES, text


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [7, 13])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_grammar_prompt_of_k_budgets_plus_delta(runners: Runners, references: References, tiny_llama: Path,
                                                tokenizer_file: Path, grammars: StructuredOutputManager,
                                                grammar: str, budget: int, k: int, delta: int,
                                                overlap: bool) -> None:
    """A constrained request whose prompt is k*budget-1, k*budget, k*budget+1 tokens: only the chunk
    that ends the prompt samples, under the grammar's first mask."""
    length = k * budget + delta
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=GRAMMARS[grammar])
    job = Job("g", tokens(length, length), 12, params=params, eos_token_ids=(EOS,))
    reference = constrained_greedy(tiny_llama, tokenizer_file, GRAMMARS[grammar])
    scenario = Scenario([job], budget=budget, overlap=overlap, references={"g": reference},
                        structured_output=grammars)
    result = check(runners, references, scenario)
    full, rest = divmod(length, budget)
    out = result.outputs["g"]
    assert chunks_of(result, "g") == [budget] * full + [rest] * (rest > 0) + [1] * (len(out) - 1)
    assert_masks_only_where_sampling(result, {"g"})
    assert_follows(tokenizer_file, grammar, out)


@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_prefills_beside_decodes(runners: Runners, references: References, tiny_llama: Path,
                                         tokenizer_file: Path, grammars: StructuredOutputManager,
                                         overlap: bool) -> None:
    """Constrained and free requests share steps: a constrained prompt's last chunk (budget-1,
    budget, budget+1 tokens long) beside free decodes; each row gets its own mask, or none."""
    budget = 8
    jobs = [Job("free", tokens(1, 3), 20)]
    refs: dict[str, Callable[[list[int], int], list[int]]] = {}
    for i, (n, grammar) in enumerate(zip((15, 16, 17), ("regex", "choice", "regex"))):
        params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=GRAMMARS[grammar])
        jobs.append(Job(f"{grammar}{n}", tokens(n, n), 12, arrive_step=2 + i, params=params, eos_token_ids=(EOS,)))
        refs[f"{grammar}{n}"] = constrained_greedy(tiny_llama, tokenizer_file, GRAMMARS[grammar])
    scenario = Scenario(jobs, budget=budget, overlap=overlap, references=refs, structured_output=grammars)
    result = check(runners, references, scenario)
    assert result.mixed_steps > 0
    assert_masks_only_where_sampling(result, set(refs))
    for req_id in refs:
        assert_follows(tokenizer_file, req_id.rstrip("0123456789"), result.outputs[req_id])
