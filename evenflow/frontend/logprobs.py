"""Logprobs as the OpenAI APIs show them: token strings, token bytes, and the two JSON forms.

A token that is only part of a character (a byte-level or ``<0xNN>`` token of a multi-byte
character) decodes to U+FFFD, so its text says nothing and many such tokens share it. Two rules
keep every token apart, as OpenAI clients expect:

* chat ``bytes`` are the token's own bytes (joining them rebuilds the text), never U+FFFD's;
* completions ``top_logprobs`` is a dict keyed by token string, so a token whose text is not its
  own (U+FFFD, or a string another token of the same entry already took) is keyed
  ``bytes:\\xNN...`` by its bytes, or ``token_id:N`` when those clash too; with
  ``return_tokens_as_token_ids`` every token is ``token_id:N``, as vLLM does.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

from evenflow.protocol import TokenLogprobs

from evenflow.frontend.detokenizer import REPLACEMENT_CHAR
from evenflow.frontend.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a logprobs entry: its text in running text, id, logprob and own bytes."""

    token: str
    token_id: int
    logprob: float
    bytes: bytes


@dataclass
class LogprobEntry:
    """One sampled token's logprob and its top alternatives, with token strings resolved."""

    token: str
    token_id: int
    logprob: float
    top: list[TokenLogprob]  # best first
    # Characters of the choice's text before this token (from the detokenizer's real deltas, so a
    # token that only completes a character shares its offset with the bytes before it).
    text_offset: int = 0
    bytes: bytes = b""


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: ByteLevel vocabularies spell bytes this way."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


class _TokenBytes:
    """Each token's own bytes for one tokenizer, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.hf.to_str()).get("decoder") or {}
        self.byte_level = '"ByteLevel"' in json.dumps(decoder)
        self.cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        found = self.cache.get(token_id)
        if found is None:
            found = self.cache[token_id] = self._uncached(token_id)
        return found

    def _uncached(self, token_id: int) -> bytes:
        tok = self.tokenizer
        text = tok.token_string(token_id)
        if REPLACEMENT_CHAR not in text:
            return text.encode("utf-8")
        piece = tok.hf.id_to_token(token_id) or ""
        if token_id in tok.byte_fallback_ids:  # "<0xE2>"
            return bytes([int(piece[3:5], 16)])
        if self.byte_level and piece and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return text.encode("utf-8")


_readers: weakref.WeakKeyDictionary[Tokenizer, _TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes ``token_id`` adds to the text (those of its characters, or its share of one)."""
    reader = _readers.get(tokenizer)
    if reader is None:
        reader = _readers[tokenizer] = _TokenBytes(tokenizer)
    return reader.of(token_id)


def format_logprobs(tokenizer: Tokenizer, sampled: list[int], entries: list[TokenLogprobs] | None,
                    text_offsets: list[int] | None = None) -> list[LogprobEntry]:
    """Resolve token strings of the engine's logprobs (sampled token first, then the top-n);
    ``text_offsets`` are where each sampled token's text starts in the choice's text."""
    result: list[LogprobEntry] = []
    if not entries:
        return result
    offsets = text_offsets if text_offsets is not None else [0] * len(sampled)
    for tok_id, e, offset in zip(sampled, entries, offsets):
        ids, lps = e.token_ids, e.logprobs
        own = lps[0] if lps else 0.0
        top = [TokenLogprob(tokenizer.token_string(i), i, lp, token_bytes(tokenizer, i))
               for i, lp in zip(ids[1:], lps[1:])]
        result.append(LogprobEntry(tokenizer.token_string(tok_id), tok_id, own, top, offset,
                                   token_bytes(tokenizer, tok_id)))
    return result


def _bytes_key(data: bytes) -> str:
    return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


def _key(token: str, token_id: int, data: bytes, as_token_id: bool) -> str:
    if as_token_id:
        return f"token_id:{token_id}"
    return _bytes_key(data) if REPLACEMENT_CHAR in token else token


def completion_logprobs_json(entries: list[LogprobEntry], text_offset_start: int = 0,
                             as_token_ids: bool = False) -> dict:
    """OpenAI legacy completions format: parallel lists plus ``top_logprobs`` dicts (one key per
    token, see the module's rules). ``text_offset`` is each entry's offset shifted by
    ``text_offset_start`` (an echoed prefix)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        sampled_key = _key(e.token, e.token_id, e.bytes, as_token_ids)
        tops: dict[str, float] = {}
        owner: dict[str, int] = {}
        for t in [*e.top, TokenLogprob(e.token, e.token_id, e.logprob, e.bytes)]:
            key = sampled_key if t.token_id == e.token_id else _key(t.token, t.token_id, t.bytes, as_token_ids)
            if owner.get(key, t.token_id) != t.token_id:  # another token has this text
                key = _bytes_key(t.bytes)
                if owner.get(key, t.token_id) != t.token_id:
                    key = f"token_id:{t.token_id}"
            if key not in owner:
                owner[key] = t.token_id
                tops[key] = t.logprob
            if t.token_id == e.token_id:
                sampled_key = key
        tokens.append(sampled_key)
        token_logprobs.append(e.logprob)
        top_logprobs.append(tops)
        offsets.append(text_offset_start + e.text_offset)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs_json(entries: list[LogprobEntry], top_n: int, as_token_ids: bool = False) -> dict:
    """OpenAI chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``, ``bytes``
    each token's own (``token_id:N`` tokens with ``return_tokens_as_token_ids``)."""
    def token(text: str, token_id: int) -> str:
        return f"token_id:{token_id}" if as_token_ids else text

    content = []
    for e in entries:
        top = [{"token": token(t.token, t.token_id), "logprob": t.logprob, "bytes": list(t.bytes)}
               for t in e.top[:top_n]]
        content.append({"token": token(e.token, e.token_id), "logprob": e.logprob, "bytes": list(e.bytes),
                        "top_logprobs": top})
    return {"content": content}
