"""Incremental detokenization is exact: streamed deltas concatenate to decode(all tokens)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from evenflow.frontend.detokenizer import IncrementalDetokenizer
from evenflow.frontend.tokenizer import Tokenizer


def _byte_fallback_tokenizer() -> Tokenizer:
    """A Llama/SentencePiece-style tokenizer: Metaspace pieces plus <0xNN> byte-fallback tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "é", "▁a", "▁b", "ab", "▁ab", "▁é", "€", "▁€", "x", "▁the", "の", "😀"]:
        vocab[piece] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>", add_bos_token=True)


BYTE_FALLBACK = _byte_fallback_tokenizer()


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip_special: bool = True,
            prompt: list[int] | None = None) -> str:
    """Push ``ids`` in chunks of the given sizes (cycled) and return the text streamed out."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special, prompt_token_ids=prompt)
    out, i, c = [], 0, 0
    while i < len(ids):
        step = max(1, chunks[c % len(chunks)]) if chunks else 1
        out.append(detok.push(ids[i:i + step]))
        i += step
        c += 1
    out.append(detok.flush())
    assert detok.token_ids == ids  # output ids only: a prompt given as context is not part of them
    return "".join(out)


def _check(tok: Tokenizer, ids: list[int], chunks: list[int], skip_special: bool = True) -> None:
    assert _stream(tok, ids, chunks, skip_special) == tok.hf.decode(ids, skip_special_tokens=skip_special)


def test_multibyte_character_split_over_byte_level_tokens(demo_tokenizer: Tokenizer) -> None:
    text = "héllo € 😀 日本語 done"
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(demo_tokenizer)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never a half character on the wire


def test_byte_fallback_pieces_join_into_characters() -> None:
    # "日" is not in the vocabulary: it becomes three <0xNN> tokens.
    ids = BYTE_FALLBACK.encode("a 日 b", add_special_tokens=False)
    assert len(ids) >= 5
    detok = IncrementalDetokenizer(BYTE_FALLBACK)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == "a 日 b"
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_at_the_end_is_flushed(demo_tokenizer: Tokenizer) -> None:
    euro = demo_tokenizer.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # byte-level BPE: one token per byte here
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert detok.push(demo_tokenizer.encode("x", add_special_tokens=False)) == "x"
    assert detok.push(euro[:1]) == ""  # held: half a character
    assert detok.flush() == "\ufffd"  # the request ended there: emit what decode() gives


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 8191), max_size=40), chunks=st.lists(st.integers(1, 5), max_size=6))
def test_random_byte_level_sequences_stream_exactly(demo_tokenizer: Tokenizer, ids: list[int], chunks: list[int]) -> None:
    _check(demo_tokenizer, ids, chunks)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, len(BYTE_FALLBACK.hf.get_vocab()) - 1), max_size=40),
       chunks=st.lists(st.integers(1, 4), max_size=6), skip_special=st.booleans())
@example(ids=[3, 1, 131], chunks=[], skip_special=True)  # a skipped special token inside a byte run
def test_random_byte_fallback_sequences_stream_exactly(ids: list[int], chunks: list[int], skip_special: bool) -> None:
    _check(BYTE_FALLBACK, ids, chunks, skip_special)


@pytest.mark.parametrize("text", ["", "plain ascii", "ünïcödé ✓ 😀😀 — 日本", "\n\n  indented\tcode()"])
def test_round_trip_of_real_text(demo_tokenizer: Tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert _stream(demo_tokenizer, ids, [1]) == text


def _stream_after(tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int]) -> str:
    return _stream(tok, ids, chunks, prompt=prompt)


def _reference_after(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What vLLM returns: the text the output adds to the prompt's text."""
    return tok.hf.decode(prompt + ids, skip_special_tokens=True)[len(tok.hf.decode(prompt, skip_special_tokens=True)):]


def test_first_word_keeps_its_leading_space_after_a_metaspace_prompt() -> None:
    vocab = BYTE_FALLBACK.hf.get_vocab()
    prompt = BYTE_FALLBACK.encode("the")
    out = [vocab["▁ab"], vocab["▁b"]]
    assert _reference_after(BYTE_FALLBACK, prompt, out) == " ab b"
    assert _stream_after(BYTE_FALLBACK, prompt, out, [1]) == " ab b"
    assert _stream_after(BYTE_FALLBACK, BYTE_FALLBACK.encode("a b a b a b the"), out, [2]) == " ab b"
    assert _stream_after(BYTE_FALLBACK, [], out, [1]) == "ab b"  # no prompt: decode(output) as before


_METASPACE_TEXT = st.text(alphabet="ab é€の😀x日\n", max_size=24)


@settings(max_examples=200, deadline=None)
@given(prompt_text=_METASPACE_TEXT, ids=st.lists(st.integers(0, len(BYTE_FALLBACK.hf.get_vocab()) - 1), max_size=30),
       chunks=st.lists(st.integers(1, 4), max_size=6))
def test_metaspace_stream_after_a_prompt_matches_decode_of_prompt_plus_output(
        prompt_text: str, ids: list[int], chunks: list[int]) -> None:
    prompt = BYTE_FALLBACK.encode(prompt_text)
    # A prompt ending inside a run of <0xNN> tokens that the output continues rewrites the
    # prompt's own text (the run decodes as one group), so the reference slice is meaningless.
    if prompt[-1] in BYTE_FALLBACK.byte_fallback_ids:
        prompt = prompt + BYTE_FALLBACK.encode("x", add_special_tokens=False)
    assert _stream_after(BYTE_FALLBACK, prompt, ids, chunks) == _reference_after(BYTE_FALLBACK, prompt, ids)


@settings(max_examples=200, deadline=None)
@given(prompt_text=st.text(max_size=30), ids=st.lists(st.integers(0, 8191), max_size=30),
       chunks=st.lists(st.integers(1, 4), max_size=6))
def test_byte_level_stream_after_a_prompt_matches_decode_of_prompt_plus_output(
        demo_tokenizer: Tokenizer, prompt_text: str, ids: list[int], chunks: list[int]) -> None:
    prompt = demo_tokenizer.encode(prompt_text)
    assert _stream_after(demo_tokenizer, prompt, ids, chunks) == _reference_after(demo_tokenizer, prompt, ids)


def test_prompt_ending_inside_a_character_streams_by_length(demo_tokenizer: Tokenizer) -> None:
    euro = demo_tokenizer.encode("€", add_special_tokens=False)
    prompt, out = demo_tokenizer.encode("x") + euro[:2], euro[2:] + demo_tokenizer.encode(" ok", add_special_tokens=False)
    assert _stream_after(demo_tokenizer, prompt, out, [1]) == _reference_after(demo_tokenizer, prompt, out)
