"""A sentencepiece GGUF vocabulary (``tokenizer.ggml.model = llama``: pieces, scores, token types,
byte fallback, no merges) read by evenflow and by transformers (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``): the same ids for ASCII, spaces, digits, emoji, CJK, control bytes, special and
user-defined tokens, and decoding that gives the text back."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from evenflow.frontend.detokenizer import IncrementalDetokenizer
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol.gguf_spm import merges_from_scores

from tests.spm_vocab import SpmVocab, spm_vocab

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces, trailing ",
    "a\nb\tc   d\n\n",
    "Numbers 12345, 2024 and 3.14159",
    "emoji 😀👍🏽 and ✓",
    "東京は日本の首都です。北京和上海",
    "bytes \x00\x01\x7f and ÿ ü ß",
    "def main():\n    print('hello')\n",
    "x</s> then <unk> and <s> mid-text",
    "<s> a text that starts with the BOS text",
    "a <|tool|> call",
    "",
    " ",
]


def write_vocab_gguf(path: Path, vocab: SpmVocab) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("context_length", 128)):
        writer.add_uint32(f"llama.{key}", value)
    vocab.write(writer)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab.tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", spm_vocab())


@pytest.fixture(scope="module")
def both(spm_file: Path) -> tuple[Tokenizer, object]:
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    return Tokenizer.from_dir(spm_file), reference


def test_the_vocabulary_looks_like_a_real_one() -> None:
    vocab = spm_vocab()
    assert vocab.tokens[3] == "<0x00>" and vocab.tokens[258] == "<0xFF>"
    assert {"\u2581the", "\u2581The", "he"} <= set(vocab.tokens) and len(vocab.tokens) > 400
    assert "😀" not in vocab.tokens and "京" in vocab.tokens  # emoji fall back to bytes; some CJK is in


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(both: tuple[Tokenizer, object], text: str) -> None:
    ours, reference = both
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_gives_the_text_back(both: tuple[Tokenizer, object], text: str) -> None:
    ours, reference = both
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    if "<s>" not in text and "<unk>" not in text and "</s>" not in text:
        # A text's own leading space merges with the prefix ▁ and is stripped with it (transformers too).
        assert ours.decode(ids) == (text[1:] if text.startswith(" ") else text)


def test_byte_fallback_and_spaces_are_sentencepiece_tokens(both: tuple[Tokenizer, object]) -> None:
    ours, _ = both
    ids = ours.encode("the 😀", add_special_tokens=False)
    pieces = [ours.hf.id_to_token(i) for i in ids]
    assert pieces[0] == "\u2581the" and pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ours.encode("x")[0] == ours.bos_token_id == 1 and ours.eos_token_id == 2


def test_streamed_deltas_join_to_the_text(both: tuple[Tokenizer, object]) -> None:
    """Token by token, as a server streams: byte-fallback runs and the ▁ spaces come out whole."""
    ours, _ = both
    prompt = ours.encode("Tell me:")
    for text in ("Hello world, 東京 😀 and 12345", " spaced  out"):
        detok = IncrementalDetokenizer(ours, prompt_token_ids=prompt)
        out = ours.encode(text, add_special_tokens=False)
        streamed = "".join(detok.push([i]) for i in out) + detok.flush()
        assert streamed == ours.decode(prompt + out)[len(ours.decode(prompt)):]


def test_merges_from_scores_rank_by_the_joined_piece() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0]
    assert merges_from_scores(tokens, scores) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    """``add_space_prefix = false`` (transformers ignores the flag; llama.cpp follows it)."""
    vocab = spm_vocab()
    path = tmp_path / "noprefix.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    vocab.write(writer, add_space_prefix=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tok = Tokenizer.from_dir(path)
    ids = tok.encode("the fox", add_special_tokens=False)
    assert tok.hf.id_to_token(ids[0]) != "\u2581the" and "\u2581fox" in [tok.hf.id_to_token(i) for i in ids]
    assert tok.decode(ids) == "the fox"
