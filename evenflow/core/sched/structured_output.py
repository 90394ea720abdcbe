"""Structured output in the engine-core: grammars compiled off the busy loop, one matcher per request.

* ``submit`` (from ``Scheduler.add_request``) starts the compile on a thread pool (validation
  included: for a large schema it costs as much as the compile, up to ~0.1 s); the request waits in
  ``WAITING_FOR_FSM`` at its place in the queue. The compile's done-callback calls ``wake`` so an
  idle loop schedules it at once instead of at its next timeout. A spec that does not compile ends
  its request with the compiler's message (``resolve``).
* Compiled grammars are cached by ``(kind, spec)`` (LRU): a request takes a ``deep_copy`` of the
  cached, never-advanced matcher. The cache holds futures, so requests that arrive while the same
  spec compiles share that one compile (counted as cache hits).
* ``fill_bitmask`` computes the token masks of one step's structured requests (llguidance's
  executor, in parallel, in Rust) as int32 bitmask rows sent with the step; ``accept`` advances a
  matcher over the tokens a step produced. A matcher only moves in ``accept``, called exactly when
  tokens are appended to the request, so after preemption by recompute its state already matches
  the tokens kept (``rebuild`` derives it from the tokens when it must be built afresh).

llguidance is the library (picked by measurement: docs/structured_output.md); it is imported when
the first structured request arrives, so an engine without it serves everything else.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.protocol import GrammarStats
from evenflow.protocol.gguf_tokenizer import tokenizer_json_text
from evenflow.protocol.structured_outputs import (
    COMPILE_BUCKETS_S, MissingGrammarLibrary, import_llguidance, to_grammar,
)

from evenflow.core.request import GrammarState, Request

log = logging.getLogger("evenflow.core.sched.structured_output")

# Test hook: seconds added to the compile of every grammar whose text contains the marker (so one
# test schema compiles slowly while the others do not). Engine-cores run as subprocesses, so the
# hook is an environment variable; it does nothing unless set.
COMPILE_DELAY_ENV = "EVENFLOW_TEST_GRAMMAR_COMPILE_DELAY_S"
COMPILE_DELAY_MARKER = "evenflow-test-slow-compile"
CACHE_SIZE = 1024  # compiled grammars kept (each a few hundred KB at most)
COMPILE_THREADS = 2


@dataclass
class CompileStats:
    """Cumulative numbers for the metrics (updated from compile threads under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS_S) + 1))
    seconds: float = 0.0
    cache_hits: int = 0

    def observe(self, seconds: float) -> None:
        index = int(np.searchsorted(COMPILE_BUCKETS_S, seconds))  # first bound >= seconds (le)
        with self.lock:
            self.bucket_counts[index] += 1
            self.seconds += seconds

    def snapshot(self) -> GrammarStats:
        """Structured outputs' part of SchedulerStats."""
        with self.lock:
            return GrammarStats(compile_buckets=list(self.bucket_counts), compile_s=self.seconds,
                                cache_hits=self.cache_hits)


class StructuredOutputManager:
    """Compiles grammars on a thread pool and keeps per-request matchers and per-step masks."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 wake: Callable[[], None] = lambda: None) -> None:
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.wake = wake
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Future[Any] | None = None  # built once, on the pool (~0.1-0.7 s)
        self._executor: Any = None  # llguidance.LLExecutor: parallel mask filling
        self._delay_s = float(os.environ.get(COMPILE_DELAY_ENV, "0") or 0)

    @property
    def words_per_row(self) -> int:
        return (self.vocab_size + 31) // 32

    # ------------------------------------------------------------------ compile

    def submit(self, request: Request) -> None:
        """Start (or share) the compile of ``request``'s grammar. Raises ValueError for what is
        known at once: two constraints, a missing library, a model folder without tokenizer.json."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.kind_and_spec()
        if key is None:
            raise ValueError("structured_outputs sets no constraint")
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            with self.stats.lock:
                self.stats.cache_hits += 1
        else:
            ll = self._start()
            compiled = self._pool.submit(self._compile, ll, *key)  # type: ignore[union-attr]
            compiled.add_done_callback(lambda _: self.wake())
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        request.grammar = GrammarState(compiled)

    def prepare(self) -> None:
        """Start building the tokenizer now, at engine start, when llguidance and tokenizer.json
        are there (a no-op otherwise): the build holds the GIL for 0.1-0.7 s, which would stall
        the loop's streams if it waited for the first structured request."""
        try:
            self._start()
        except ValueError:
            pass  # no library or no tokenizer: structured requests will be refused with the reason

    def _start(self) -> Any:
        """llguidance, the pool and the tokenizer build, on first use."""
        try:
            ll = import_llguidance()
        except MissingGrammarLibrary as e:
            raise ValueError(str(e)) from None
        if self._pool is None:
            if not self.tokenizer_file.is_file():
                raise ValueError(f"structured output needs the model's tokenizer: {self.tokenizer_file} is missing")
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            self._tokenizer = self._pool.submit(self._build_tokenizer, ll)
            self._executor = ll.LLExecutor()
        return ll

    def _build_tokenizer(self, ll: Any) -> Any:
        from tokenizers import Tokenizer

        text = tokenizer_json_text(self.tokenizer_file)  # a GGUF file's is built from its metadata
        n_vocab = max(self.vocab_size, Tokenizer.from_str(text).get_vocab_size(True))
        return ll.LLTokenizer(text, n_vocab=n_vocab, eos_token=self.eos_token_ids)

    def _compile(self, ll: Any, kind: str, spec: str) -> Any:
        """On a pool thread: the template matcher (validation, construction and the first mask,
        where llguidance builds its lexer), timed for the histogram. Raises ValueError with the
        compiler's message."""
        tokenizer = self._tokenizer.result()  # type: ignore[union-attr]
        start = time.perf_counter()
        grammar = to_grammar(kind, spec)
        if self._delay_s and COMPILE_DELAY_MARKER in grammar:
            time.sleep(self._delay_s)
        matcher = ll.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        scratch = np.empty((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        self.stats.observe(time.perf_counter() - start)
        return matcher

    def resolve(self, request: Request) -> str | None:
        """For a request in WAITING_FOR_FSM: None while compiling; "" once its matcher is ready
        (built from the tokens it already has); the compiler's message if the compile failed."""
        state = request.grammar
        assert state is not None
        if not state.compiled.done():
            return None
        error = state.compiled.exception()
        if error is not None:
            return str(error) if isinstance(error, ValueError) else f"grammar compilation failed: {error!r}"
        self.rebuild(request)
        return ""

    def rebuild(self, request: Request) -> None:
        """A fresh matcher advanced over the request's output tokens so far."""
        state = request.grammar
        assert state is not None
        state.matcher = state.compiled.result().deep_copy()
        if request.num_output_tokens:
            self.accept(request, list(request.output_token_ids))

    # ------------------------------------------------------------------ steps

    def fill_bitmask(self, requests: Sequence[Request]) -> bytes:
        """The next-token masks of ``requests`` (all compiled), one int32 row each, as bytes."""
        bitmask = np.empty((len(requests), self.words_per_row), dtype=np.int32)
        matchers = [(request.grammar.matcher, i) for i, request in enumerate(requests)]  # type: ignore[union-attr]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, bitmask.shape[1] * 4, len(requests))
        return bitmask.tobytes()

    def accept(self, request: Request, token_ids: Sequence[int]) -> None:
        """Advance ``request``'s matcher over tokens it produced. After the grammar has ended
        (only EOS allowed) further tokens (EOS under ``ignore_eos``) leave it where it is."""
        matcher = request.grammar.matcher  # type: ignore[union-attr]
        for token_id in token_ids:
            if matcher.is_stopped():
                return
            if not matcher.consume_token(token_id):
                log.warning("request %s: token %d rejected by its grammar: %s", request.request_id, token_id,
                            matcher.get_error())
                return

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
