"""A random-weight llama GGUF with a sentencepiece vocabulary (tests/spm_vocab.py), served from text
prompts through ``LLM``: prompt ids, greedy ids and text equal transformers loading the same file
(``AutoTokenizer`` and ``AutoModelForCausalLM`` with ``gguf_file=``), float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from evenflow.frontend.llm import LLM, SamplingParams

from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.spm_vocab import spm_vocab

PROMPTS = ["The quick brown fox", "東京 😀 and numbers 12345", " spaced  out"]  # none ends in a byte run


@pytest.mark.slow
def test_spm_gguf_serves_the_greedy_tokens_transformers_gives(checkpoint_root: Path, tmp_path: Path) -> None:
    import transformers

    vocab = spm_vocab()
    folder = make_checkpoint(checkpoint_root, seed=7, vocab_size=len(vocab.tokens), bos_token_id=1, eos_token_id=2)
    path = write_gguf(folder, tmp_path / "spm-llama.gguf", tokenizer=vocab.write)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    with LLM(model=str(path), dtype="float32", max_model_len=128, num_kv_blocks=32,
             max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    assert [(o.prompt_token_ids, o.token_ids) for o in outs] == expected
    assert [o.text for o in outs] == [tokenizer.decode(ids, skip_special_tokens=True) for _, ids in expected]
