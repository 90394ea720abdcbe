"""Per-request output assembly: engine token deltas -> text deltas, stop strings, logprobs.

One ``ChoiceAssembler`` follows one engine request (one of a completion's ``n`` choices). The
engine sends token ids; the assembler detokenizes them incrementally, watches for stop strings
across token boundaries (holding back just enough text that a stop string split over deltas is
never streamed) and resolves logprobs (``logprobs.py``). It never touches sockets: callers abort the engine request
when ``ChoiceDelta.stopped_by_string`` comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.protocol import PromptLogprobs, RequestOutput

from evenflow.frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from evenflow.frontend.logprobs import LogprobEntry, format_logprobs
from evenflow.frontend.tokenizer import Tokenizer


class StopStringMatcher:
    """Finds the first stop string in a text stream; holds back a possible partial match.

    ``feed(delta, final)`` returns ``(text_to_emit, matched_stop_or_None)``. After a match, the
    text up to (and, with ``include_stop_str_in_output``, including) the stop string is emitted
    and nothing after it.
    """

    __slots__ = ("stops", "include_stop", "hold", "_pending")

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop_str_in_output
        # A stop string can straddle deltas: keep its longest proper prefix back.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        if not self.stops:
            return delta, None
        text = self._pending + delta
        best_pos, best_stop = -1, None
        for stop in self.stops:
            pos = text.find(stop)
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best_stop = pos, stop
        if best_stop is not None:
            self._pending = ""
            end = best_pos + (len(best_stop) if self.include_stop else 0)
            return text[:end], best_stop
        if final or self.hold == 0:
            self._pending = ""
            return text, None
        cut = max(0, len(text) - self.hold)
        self._pending = text[cut:]
        return text[:cut], None


@dataclass
class ChoiceDelta:
    """What one engine update adds to a choice."""

    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_by_string: bool = False

    @property
    def is_empty(self) -> bool:
        """No token, no text, no ending: nothing to stream. (A token whose text is held back --
        half a character, a possible stop string -- is not empty: it streams with empty text,
        as vLLM does, so clients see every token arrive.)"""
        return not self.text and not self.token_ids and self.finish_reason is None


@dataclass
class ChoiceAssembler:
    """Assembles one choice from its engine request's RequestOutput deltas."""

    tokenizer: Tokenizer
    index: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_token_ids: list[int] = field(default_factory=list)  # decoding context for the first tokens
    detok: IncrementalDetokenizer = field(init=False)
    matcher: StopStringMatcher = field(init=False)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # the engine's rows, on the first output
    detok_chars: int = 0  # length of all detokenized text so far (before stop-string truncation)

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens, self.prompt_token_ids)
        self.matcher = StopStringMatcher(self.stop, self.include_stop_str_in_output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: RequestOutput) -> ChoiceDelta:
        """Fold one engine delta in; return the new text/tokens/logprobs of this choice."""
        if self.finished:  # late outputs after a stop-string match: ignore
            return ChoiceDelta("", [], None)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        new_ids = list(out.new_token_ids)
        shown = shown_token_count(new_ids, out.finish_reason, self.include_stop_str_in_output)
        offsets: list[int] | None = None
        if out.logprobs is None:
            text = self.detok.push(new_ids[:shown])
        else:  # one token at a time, to know where each token's text starts
            offsets, parts, at = [], [], self.detok_chars
            for tok in new_ids[:shown]:
                held = self.detok.has_pending
                piece = self.detok.push([tok])
                offsets.append(at + _own_text_start(self.tokenizer, tok, piece) if held else at)
                parts.append(piece)
                at += len(piece)
            offsets += [at] * (len(new_ids) - shown)  # the stop token: where the text ends
            text = "".join(parts)
        final = out.finish_reason is not None
        if final:
            text += self.detok.flush()
        self.detok_chars += len(text)
        text, matched = self.matcher.feed(text, final=final)
        lps = format_logprobs(self.tokenizer, new_ids, out.logprobs, offsets) if out.logprobs is not None else None
        self.text += text
        self.token_ids.extend(new_ids)
        if lps:
            self.logprobs.extend(lps)
        delta = ChoiceDelta(text, new_ids, lps)
        if matched is not None:
            self.finish_reason = delta.finish_reason = "stop"
            self.stop_reason = delta.stop_reason = matched
            delta.stopped_by_string = True
        elif final:
            self.finish_reason = delta.finish_reason = out.finish_reason
            self.stop_reason = delta.stop_reason = out.stop_reason
        return delta


def shown_token_count(new_ids: list[int], engine_finish_reason: str | None, include_stop_str_in_output: bool) -> int:
    """How many of a delta's tokens show in the text. The engine finishes with "stop" only on an
    EOS or stop token, the delta's last: as vLLM, that token stays in ``token_ids`` and out of the
    text (whether or not it is special) unless ``include_stop_str_in_output``."""
    if engine_finish_reason == "stop" and new_ids and not include_stop_str_in_output:
        return len(new_ids) - 1
    return len(new_ids)


def _own_text_start(tokenizer: Tokenizer, token_id: int, piece: str) -> int:
    """Where ``token_id``'s own text starts in ``piece``, the delta its push released together with
    held-back text of earlier tokens (a byte-fallback run ends only when a later token comes)."""
    own = tokenizer.token_string(token_id)
    if own and REPLACEMENT_CHAR not in own and piece.endswith(own):
        return len(piece) - len(own)
    return 0  # the token completes a held character: it starts where that character does
