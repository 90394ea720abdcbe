"""The tokenizer evenflow builds from the GGUF's metadata against transformers' from the same file:
ids for varied text (spaces, newlines, code, accents, CJK, emoji, special tokens), decode, BOS/EOS,
and the chat template's token ids against ``apply_chat_template``."""

from __future__ import annotations

from typing import Any

import pytest

from evenflow.frontend.chat_template import render_chat
from evenflow.frontend.tokenizer import Tokenizer

TEXTS = [
    "What is the capital of France?",
    "  two leading spaces,\n\n\ttabs and trailing   ",
    "naïve café, Straße, 日本語のテキスト, emoji 🤖🎉 and math ∑x²",
    "def f(x):\n    return {'a': [1, 2, 3]}  # 1234567890 don't I'll we're",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<repo_name>evenflow<file_sep>README.md",
    "",
]
# The first test waits for transformers' tokenizer build from the GGUF (seconds, more when shared).
pytestmark = pytest.mark.timeout(900)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about GPUs."}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_equal_transformers(smollm2_tokenizer: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_tokenizer(text).input_ids
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert smollm2_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_vocabulary(smollm2_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert (smollm2_tokenizer.bos_token, smollm2_tokenizer.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert smollm2_tokenizer.eos_token == "<|im_end|>" and smollm2_tokenizer.eos_token_id == 2
    assert not smollm2_tokenizer.add_bos_token
    assert smollm2_tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert smollm2_tokenizer.special_ids == frozenset(hf_tokenizer.all_special_ids) | {
        i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "system", "multi-turn"])
def test_chat_template_ids_equal_apply_chat_template(smollm2_tokenizer: Tokenizer, hf_tokenizer: Any,
                                                     messages: list[dict[str, str]]) -> None:
    text = render_chat(smollm2_tokenizer.chat_template, messages, True, smollm2_tokenizer.bos_token,
                       smollm2_tokenizer.eos_token)
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert smollm2_tokenizer.encode(text, add_special_tokens=False) == list(expected)
