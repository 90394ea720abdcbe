"""Incremental detokenization: text deltas for new tokens, exact and without re-decoding everything.

Each step decodes only a short window: the tokens since ``prefix_offset``. ``prefix_offset`` ..
``read_offset`` are tokens whose text was already emitted (kept as context, because decoders such
as Metaspace or WordPiece change a token's text depending on what precedes it); everything after
``read_offset`` is new. The delta is ``decode(window) - decode(context)``. When the window's text
ends in U+FFFD the last tokens are an incomplete UTF-8 sequence (a multi-byte character split over
byte-level or byte-fallback tokens), so nothing is emitted until a later token completes it, or
until ``flush`` at the end of the request. The cut point only moves to where the text ended on a
complete character, and UTF-8 is self-synchronizing, so the concatenation of deltas equals
``decode(all tokens)``. For byte-fallback tokenizers (``<0xNN>`` tokens, decoded run by run, where
one bad byte spoils its whole run) the cut also never falls inside a run of byte tokens.
"""

from __future__ import annotations

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    ``push(ids)`` appends new ids and returns the new text that is final; ``flush()`` returns what
    was held back (call it once when the request finishes). ``token_ids`` holds every output id.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset", "_prefix_text")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset]), cached

    def push(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the text they complete (possibly empty)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any text still held back (an incomplete character at the very end)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if not final and self._inside_byte_run():
            return ""  # a run of <0xNN> tokens decodes as one group: wait until it ends
        decode = self.tokenizer.hf.decode
        window = self.token_ids[self.prefix_offset:]
        text = decode(window, skip_special_tokens=self.skip_special_tokens)
        prefix = self._prefix_text
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT_CHAR) and not final):
            # Nothing new yet (special tokens skipped) or an incomplete character: wait.
            return ""
        if not text.startswith(prefix):
            # A decoder rewrote the context text (should not happen with BPE/byte-level/Metaspace
            # tokenizers); fall back to a full decode to stay exact.
            return self._full_decode_delta(text_before=self._emitted_text())
        delta = text[len(prefix):]
        # The new context is everything from the old read point on; its text is the delta plus
        # nothing else only if decoding from there gives the same string, so decode it once.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset],
                                   skip_special_tokens=self.skip_special_tokens)
        return delta

    def _inside_byte_run(self) -> bool:
        """Whether the last (non-skipped) token is a <0xNN> byte token. A skipped special token
        does not end a run: the decoder joins the bytes on both sides of it."""
        byte_ids = self.tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        special = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
        for token_id in reversed(self.token_ids):
            if token_id not in special:
                return token_id in byte_ids
        return False

    def _emitted_text(self) -> str:
        return self.tokenizer.hf.decode(self.token_ids[: self.read_offset], skip_special_tokens=self.skip_special_tokens)

    def _full_decode_delta(self, text_before: str) -> str:
        full = self.tokenizer.hf.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self._prefix_text = ""
        return full[len(text_before):] if full.startswith(text_before) else full
