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

The window starts out with the last few prompt tokens as context (as vLLM does): decoders such as
Metaspace strip the leading space of the first token they decode, which must hit a prompt token,
not the first generated word. The deltas then equal ``decode(prompt + output)[len(decode(prompt)):]``.
"""

from __future__ import annotations

from evenflow.frontend.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for any decoder's look-behind (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    ``push(ids)`` appends new ids and returns the new text that is final; ``flush()`` returns what
    was held back (call it once when the request finishes). ``token_ids`` holds every output id;
    ``prompt_token_ids`` (optional) gives the decoding context the first output tokens follow.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset", "_prefix_text",
                 "_ids")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # output ids only
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context  # context + output ids: what the offsets index
        self.prefix_offset = 0
        self.read_offset = len(context)
        # decode(_ids[prefix_offset:read_offset]), cached
        self._prefix_text = tokenizer.hf.decode(context, skip_special_tokens=skip_special_tokens) if context else ""

    def push(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the text they complete (possibly empty)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    @property
    def has_pending(self) -> bool:
        """Whether some pushed tokens' text is still held back (or was empty)."""
        return self.read_offset < len(self._ids)

    def flush(self) -> str:
        """Return any text still held back (an incomplete character at the very end)."""
        if self.read_offset >= len(self._ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if not final and self._inside_byte_run():
            return ""  # a run of <0xNN> tokens decodes as one group: wait until it ends
        decode = self.tokenizer.hf.decode
        window = self._ids[self.prefix_offset:]
        text = decode(window, skip_special_tokens=self.skip_special_tokens)
        prefix = self._prefix_text
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT_CHAR) and not final):
            # Nothing new yet (special tokens skipped) or an incomplete character: wait.
            return ""
        if text.startswith(prefix):
            delta = text[len(prefix):]
        else:
            # A decoder rewrote the context text (a prompt ending inside a character whose last
            # bytes the output brings, or a byte run turned invalid): take the difference of full
            # decodes by length, which is what decode(all)[len(decode(before)):] gives.
            delta = self._full_decode_delta()
        # The new context is everything from the old read point on; its text is the delta plus
        # nothing else only if decoding from there gives the same string, so decode it once.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self._prefix_text = decode(self._ids[self.prefix_offset:self.read_offset],
                                   skip_special_tokens=self.skip_special_tokens)
        return delta

    def _inside_byte_run(self) -> bool:
        """Whether the last (non-skipped) token is a <0xNN> byte token. A skipped special token
        does not end a run: the decoder joins the bytes on both sides of it."""
        byte_ids = self.tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        special = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
        for token_id in reversed(self._ids):
            if token_id not in special:
                return token_id in byte_ids
        return False

    def _full_decode_delta(self) -> str:
        decode = self.tokenizer.hf.decode
        before = decode(self._ids[:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        return decode(self._ids, skip_special_tokens=self.skip_special_tokens)[len(before):]
