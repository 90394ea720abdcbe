"""A request's state inside the engine-core, and the queues that order waiting requests.

Progress is one integer, ``num_computed_tokens``: prefill and decode are not stored phases but how
far that integer is behind the request's tokens. Token lists are private; everybody else reads them
through read-only views, and one method appends to both the output and the all-tokens list.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, overload

from evenflow.protocol import PromptLogprobs, SamplingParams
from evenflow.protocol.block_hash import adapter_extra_keys
from evenflow.protocol.lora import AdapterRef


@dataclass
class GrammarState:
    """One request's grammar: its compile (shared through the cache), then its own matcher."""

    compiled: Future[Any]  # -> the cached template LLMatcher
    matcher: Any = None  # llguidance.LLMatcher once compiled


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every value above PREEMPTED is final."""

    WAITING = 0
    WAITING_FOR_FSM = 1  # structured output: grammar still compiling
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The wire's finish reason ("stop" / "length" / "abort" / "error"), None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class ConstantList(Sequence[int]):
    """A read-only view of a token list owned by someone else (no copy)."""

    __slots__ = ("_items",)

    def __init__(self, items: list[int]) -> None:
        self._items = items

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._items[index]  # a slice is a fresh list, so the owner's list stays private

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __contains__(self, value: object) -> bool:
        return value in self._items

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._items == other._items
        return self._items == other

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


class Request:
    """One sequence being generated: tokens, progress, status, and what the scheduler tracks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.held = False  # its reader is behind (a Hold): not scheduled until released
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the stop token that ended it (not EOS)

        self._prompt_token_ids = list(prompt_token_ids)
        self._all_token_ids = list(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.prompt_token_ids = ConstantList(self._prompt_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.num_prompt_tokens = len(self._prompt_token_ids)
        # len(all tokens), kept by the append method: the scheduler reads it for every request
        # every step, and a plain attribute costs a fraction of a property call.
        self.num_tokens = self.num_prompt_tokens

        # Drafts the worker proposed after the last step (it keeps the tokens): slots wanted next.
        self.num_proposed_drafts = 0
        # Tokens whose KV is computed or scheduled to be (advanced when a step is scheduled).
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled but not returned yet (overlap keeps steps in flight).
        self.num_output_placeholders = 0
        # Prompt tokens served by the prefix cache when first scheduled (for reporting).
        self.num_cached_tokens = 0
        # Hashes of this request's full blocks, in order; extended as blocks fill.
        self.block_hashes: list[bytes] = []
        # Anything besides the tokens that changes the KV (an adapter, a cache salt): part of
        # every block hash, so requests that differ here never share blocks.
        self.cache_extra_keys: tuple[object, ...] | None = None
        # Step that first scheduled this request (-1: never): outputs of older steps are stale.
        self.first_scheduled_step = -1
        self.first_scheduled_time = 0.0  # unix seconds; for the queue-time metric
        # Structured output: its compile and matcher (set by StructuredOutputManager.submit).
        self.grammar: GrammarState | None = None
        # prompt_logprobs: every position is computed (vLLM V1's rule), the rows gathered chunk by
        # chunk until the first output carries them.
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobs | None = None
        # The LoRA adapter serving it (None: the base model); set with set_lora.
        self.lora: AdapterRef | None = None

    def set_lora(self, adapter: AdapterRef | None) -> None:
        """Serve it with ``adapter``: its identity enters every block hash (other KV than the base's)."""
        self.lora = adapter
        self.cache_extra_keys = adapter_extra_keys(adapter.identity if adapter is not None else None)

    def add_prompt_logprobs(self, rows: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:  # a copy: the step's output is not ours to grow
            self.prompt_logprobs = PromptLogprobs(list(rows.token_ids), list(rows.logprobs), list(rows.ranks))
        else:
            self.prompt_logprobs.extend(rows)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        rows, self.prompt_logprobs = self.prompt_logprobs, None
        return rows

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """The one way tokens are added: output and all-tokens lists grow together."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.num_tokens = len(self._all_token_ids)

    @property
    def use_structured_output(self) -> bool:
        """A grammar constrains its tokens: it is never given drafts to verify (speculation off)."""
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + self.num_proposed_drafts

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def is_prefilling(self) -> bool:
        """Derived phase: some prompt token has no KV yet."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def check_stop(self, last_token: int, max_model_len: int) -> RequestStatus | None:
        """The finished status ``last_token`` (just appended) leads to, or None to go on.

        ``min_tokens`` holds back EOS and stop tokens only; length limits always apply.
        """
        sampling_params = self.sampling_params
        num_output = self.num_tokens - self.num_prompt_tokens
        if num_output >= sampling_params.min_tokens:
            if last_token in self.stop_token_ids:
                self.stop_reason = last_token
                return RequestStatus.FINISHED_STOPPED
            if not sampling_params.ignore_eos and last_token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= sampling_params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def sort_key(self) -> tuple[int, float]:
        """Order under the ``priority`` policy: smaller priority value first, then arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders})"
        )


class FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Waiting requests by (priority, arrival time, insertion order); kept sorted, head first."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._requests: list[Request] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._counter))
        index = bisect.bisect(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)

    add_front = add  # a preempted request goes where its priority puts it

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        index = self._requests.index(request)
        del self._keys[index]
        del self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


WaitingQueue = FCFSQueue | PriorityQueue
