"""An in-process stand-in for EngineClient: same API, scripted token streams, no sockets."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from evenflow.frontend.clients.errors import EngineError
from evenflow.protocol import (
    Ready, RequestOutput, SamplingParams, SchedulerCounts, SchedulerStats, TokenLogprobs, UtilityResult,
)


class FakeEngineClient:
    """Yields ``script`` (cycled) token ids, ``tokens_per_step`` at a time, until max_tokens."""

    def __init__(self, model_path: str, script: list[int], max_model_len: int = 256, vocab_size: int = 8192,
                 tokens_per_step: int = 1, step_delay: float = 0.0, model_aliases: tuple[str, ...] = ()) -> None:
        self.model_path = model_path
        self.script = script
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.model_aliases = model_aliases
        self.ready: Ready | None = None
        self.stats: SchedulerStats | None = SchedulerStats()
        self.aborted: list[str] = []  # requests aborted while live (deduplicated)
        self.abort_messages: list[str] = []  # every Abort a real EngineClient would send, duplicates kept
        self.live: set[str] = set()
        self.submitted: list[tuple[str, list[int], SamplingParams, int]] = []
        self.refuse: tuple[str, str] | None = None  # (code, message): refuse every request with it

    @property
    def connected(self) -> bool:
        return self.ready is not None

    failure: EngineError | None = None

    async def connect(self, timeout: float = 30.0) -> Ready:
        self.ready = Ready(1, "fake-model", self.model_path, self.max_model_len, self.vocab_size, [1], 16, 100, 64, "fake",
                           model_aliases=list(self.model_aliases))
        return self.ready

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None,
                       timeout_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        if self.refuse is not None:
            raise EngineError(*self.refuse, request_id)
        self.submitted.append((request_id, list(prompt_token_ids), sampling_params, priority))
        self.live.add(request_id)
        produced = 0
        finished = False
        try:
            while produced < sampling_params.max_tokens:
                await asyncio.sleep(self.step_delay)
                k = min(self.tokens_per_step, sampling_params.max_tokens - produced)
                ids = [self.script[(produced + i) % len(self.script)] for i in range(k)]
                produced += k
                lps = None
                if sampling_params.logprobs is not None:
                    lps = [TokenLogprobs([t, *range(10, 10 + sampling_params.logprobs)],
                                         [-0.5, *[-1.0 - j for j in range(sampling_params.logprobs)]], 1) for t in ids]
                finished = produced >= sampling_params.max_tokens
                yield RequestOutput(request_id, ids, "length" if finished else None, 0, lps)
        finally:
            if not finished:  # as EngineClient.generate: closing an unfinished stream sends an Abort
                self.abort_messages.append(request_id)
            if request_id in self.live:
                self.live.discard(request_id)
                if produced < sampling_params.max_tokens:
                    self.aborted.append(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_messages.extend(request_ids)
        for rid in request_ids:
            if rid in self.live:
                self.aborted.append(rid)
                self.live.discard(rid)

    async def call_utility(self, method: str, timeout: float = 30.0) -> UtilityResult:
        return UtilityResult(0, True, SchedulerStats(scheduler=SchedulerCounts(num_running=len(self.live))))

    async def close(self) -> None:
        pass
