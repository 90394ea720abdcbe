"""Stop strings across token boundaries, output assembly and logprobs formatting."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from evenflow.frontend.logprobs import chat_logprobs_json, completion_logprobs_json, format_logprobs
from evenflow.frontend.outputs import ChoiceAssembler, StopStringMatcher
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import RequestOutput, TokenLogprobs


def _feed_all(m: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for i, p in enumerate(pieces):
        text, matched = m.feed(p, final=i == len(pieces) - 1)
        out.append(text)
        if matched:
            return "".join(out), matched
    return "".join(out), None


def test_stop_string_split_over_deltas_is_never_streamed() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello", None)  # " ST" could begin "STOP": held back
    assert m.feed("O") == (" ", None)
    assert m.feed("Px") == ("", "STOP")


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["\n\n", "END"], include_stop_str_in_output=True)
    assert _feed_all(m, ["a", "b\n", "\nc"]) == ("ab\n\n", "\n\n")


def test_earliest_stop_string_wins() -> None:
    assert _feed_all(StopStringMatcher(["bc", "abcd"]), ["xab", "cd"]) == ("x", "abcd")
    assert _feed_all(StopStringMatcher(["cd", "ab"]), ["xa", "bcd"]) == ("x", "ab")


def test_no_match_flushes_everything_at_the_end() -> None:
    m = StopStringMatcher(["zzz"])
    assert _feed_all(m, ["ab", "cz", "z"]) == ("abczz", None)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcS TOP", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       include=st.booleans())
def test_stop_matching_is_independent_of_how_text_is_split(text: str, cuts: list[int], include: bool) -> None:
    stops = ["STOP", "aa"]
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    got = _feed_all(StopStringMatcher(stops, include), pieces)
    # Reference: search the whole text at once.
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos, stop = min(hits)
        assert got == (text[:pos + (len(stop) if include else 0)], stop)
    else:
        assert got == (text, None)


def test_assembler_stops_on_a_string_spanning_tokens(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("one two three four", add_special_tokens=False)
    asm = ChoiceAssembler(demo_tokenizer, stop=["thr"])
    deltas = [asm.update(RequestOutput("r", [t])) for t in ids]
    stopped = [d for d in deltas if d.stopped_by_string]
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop" and stopped[0].stop_reason == "thr"
    assert asm.text == "one two " and "".join(d.text for d in deltas) == "one two "
    assert asm.finished


def test_assembler_passes_engine_finish_through(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("héllo €", add_special_tokens=False)
    asm = ChoiceAssembler(demo_tokenizer)
    d1 = asm.update(RequestOutput("r", ids[:-1], num_cached_tokens=16))
    d2 = asm.update(RequestOutput("r", ids[-1:], "length", 16))
    assert d1.text + d2.text == "héllo €"
    assert (d2.finish_reason, asm.num_cached_tokens, asm.token_ids) == ("length", 16, ids)


def test_the_stopping_token_stays_in_token_ids_and_out_of_the_text(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("one two.", add_special_tokens=False)
    stop = ids[-1]  # a plain (not special) token, as stop_token_ids may name
    for logprobs in (None, _lps(ids[-2:])):
        for include in (False, True):
            asm = ChoiceAssembler(demo_tokenizer, include_stop_str_in_output=include)
            asm.update(RequestOutput("r", ids[:-2]))
            d = asm.update(RequestOutput("r", ids[-2:], "stop", 0, logprobs, stop))
            want = demo_tokenizer.decode(ids if include else ids[:-1])
            assert asm.text == want and (d.finish_reason, d.stop_reason, asm.token_ids) == ("stop", stop, ids)
            if logprobs is not None:  # the stop token's entry sits where the text ends
                assert [e.token_id for e in d.logprobs] == ids[-2:] and d.logprobs[1].text_offset == len(
                    demo_tokenizer.decode(ids[:-1]))
    # "length" ends on an ordinary token: it is text like any other.
    asm = ChoiceAssembler(demo_tokenizer)
    asm.update(RequestOutput("r", ids, "length"))
    assert asm.text == "one two."


def test_logprob_bytes_are_each_tokens_own_and_keys_never_merge(demo_tokenizer: Tokenizer) -> None:
    text = "¿cómo 🯸"
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    asm = ChoiceAssembler(demo_tokenizer)
    # Every token reports the others as its alternatives: several decode to U+FFFD alone.
    lps = [TokenLogprobs([t, *ids], [-0.5, *[-1.0 - j for j in range(len(ids))]], 1) for t in ids]
    asm.update(RequestOutput("r", ids, "length", logprobs=lps))
    chat = chat_logprobs_json(asm.logprobs, top_n=len(ids))["content"]
    assert b"".join(bytes(c["bytes"]) for c in chat) == text.encode()
    partial = [c for c in chat if c["token"] == "\ufffd"]
    assert partial, "the text should hold tokens that are part of a character"
    legacy = completion_logprobs_json(asm.logprobs)
    for top, token in zip(legacy["top_logprobs"], legacy["tokens"]):
        assert len(top) == len(set(ids)) and token in top and "\ufffd" not in "".join(top)
    as_ids = completion_logprobs_json(asm.logprobs, as_token_ids=True)
    assert as_ids["tokens"] == [f"token_id:{t}" for t in ids]
    assert set(as_ids["top_logprobs"][0]) == {f"token_id:{t}" for t in ids}
    assert chat_logprobs_json(asm.logprobs, 1, as_token_ids=True)["content"][0]["token"] == f"token_id:{ids[0]}"


def test_logprobs_formats(demo_tokenizer: Tokenizer) -> None:
    a, b = demo_tokenizer.encode("def", add_special_tokens=False)[0], demo_tokenizer.encode(" x", add_special_tokens=False)[0]
    entries = format_logprobs(demo_tokenizer, [a], [TokenLogprobs([a, b, a], [-0.1, -0.5, -0.1], 1)])
    assert entries[0].token == "def" and entries[0].logprob == -0.1
    legacy = completion_logprobs_json(entries, text_offset_start=3)
    assert legacy == {"tokens": ["def"], "token_logprobs": [-0.1], "top_logprobs": [{" x": -0.5, "def": -0.1}],
                      "text_offset": [3]}
    chat = chat_logprobs_json(entries, top_n=1)
    assert chat["content"][0]["token"] == "def" and chat["content"][0]["bytes"] == list(b"def")
    assert chat["content"][0]["top_logprobs"] == [{"token": " x", "logprob": -0.5, "bytes": list(b" x")}]


def _lps(ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs([t], [-0.25], 1) for t in ids]


def test_logprob_tokens_and_offsets_follow_the_real_text_metaspace() -> None:
    from .test_detokenizer import BYTE_FALLBACK as tok

    vocab = tok.hf.get_vocab()
    out = [vocab["▁ab"], vocab["▁b"], vocab["<0xE6>"], vocab["<0x97>"], vocab["<0xA5>"], vocab["x"]]
    asm = ChoiceAssembler(tok, prompt_token_ids=tok.encode("the"))
    asm.update(RequestOutput("r", out[:4], logprobs=_lps(out[:4])))
    asm.update(RequestOutput("r", out[4:], "length", logprobs=_lps(out[4:])))
    assert asm.text == " ab b日x"
    assert [e.token for e in asm.logprobs] == [" ab", " b", "\ufffd", "\ufffd", "\ufffd", "x"]
    # The three bytes of 日 share its offset; "x" starts after the one character they make.
    assert [e.text_offset for e in asm.logprobs] == [0, 3, 5, 5, 5, 6]
    assert completion_logprobs_json(asm.logprobs)["text_offset"] == [0, 3, 5, 5, 5, 6]
    assert tok.token_string(vocab["<0x0A>"]) == "\n" and tok.token_string(vocab["▁"]) == " "
    assert tok.token_string(vocab["<s>"]) == "<s>"


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), cut=st.integers(1, 4))
def test_logprob_offsets_index_each_tokens_text_byte_level(demo_tokenizer: Tokenizer, text: str, cut: int) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    # A special token's text (hypothesis mines "<|im_end|>" from the sources) is skipped in the
    # output, as vLLM's skip_special_tokens does; that is not what this test is about.
    assume(not demo_tokenizer.special_ids.intersection(ids))
    asm = ChoiceAssembler(demo_tokenizer, prompt_token_ids=demo_tokenizer.encode("say:"))
    for i in range(0, len(ids), cut):
        chunk = ids[i:i + cut]
        asm.update(RequestOutput("r", chunk, "length" if i + cut >= len(ids) else None, logprobs=_lps(chunk)))
    assert asm.text == text
    offsets = [e.text_offset for e in asm.logprobs]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for e, start, end in zip(asm.logprobs, offsets, offsets[1:] + [len(text)]):
        if "\ufffd" not in e.token:  # a whole-character token: its string is exactly its text
            assert text[start:end] == e.token
