"""Runs the engine requests behind one API request and merges their deltas.

An API request has one or more prompts and ``n`` choices per prompt; each choice is one engine
request (``f"{request_id}-{index}"``). ``Generation.stream()`` yields ``(job, ChoiceDelta)`` as
deltas arrive, in arrival order. A stop-string match aborts that engine request at once, by
closing its stream (its KV blocks free immediately); a consumer that stops early (a client
disconnect cancels it) aborts every unfinished engine request. Shared by the HTTP server and the offline ``LLM``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from evenflow.protocol import AdapterRef, RequestOutput, SamplingParams

from evenflow.frontend.metrics import FrontendMetrics, RequestTimer
from evenflow.frontend.outputs import ChoiceAssembler, ChoiceDelta
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.frontend.choices import ChoicePlan

_MERGED_PER_JOB = 4  # deltas of each choice waiting for the consumer of a merged stream

# Detached abort tasks: kept referenced until done (asyncio holds tasks only weakly).
_background: set[asyncio.Task] = set()


def _detach(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


@dataclass
class ChoiceJob:
    """One choice = one engine request."""

    index: int
    engine_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    assembler: ChoiceAssembler
    timer: RequestTimer | None = None
    # Set by Generation.admit(): the submitted stream and its first output, replayed by stream().
    agen: Any = None
    first: RequestOutput | None = None


class Generation:
    """The engine requests of one API request (``len(plans) * n`` jobs)."""

    def __init__(
        self,
        client: Any,
        tokenizer: Tokenizer,
        request_id: str,
        plans: list[ChoicePlan],
        metrics: FrontendMetrics | None = None,
        arrival_time: float | None = None,
        timeout_s: float = 0.0,
        lora: AdapterRef | None = None,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.lora = lora  # the LoRA adapter of every job (None: the base model)
        self.metrics = metrics
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.plans = plans
        self.jobs: list[ChoiceJob] = []
        for p_idx, plan in enumerate(plans):
            for params in plan.params:
                index = len(self.jobs)
                asm = ChoiceAssembler(tokenizer, index, plan.stop, plan.include_stop_str_in_output,
                                      plan.skip_special_tokens, plan.prompt_token_ids)
                self.jobs.append(ChoiceJob(index, f"{request_id}-{index}", p_idx, plan.prompt_token_ids, params, asm))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.plans)

    @property
    def num_cached_tokens(self) -> int:
        # Choices of one prompt share its cached prefix: count each prompt once.
        best: dict[int, int] = {}
        for j in self.jobs:
            best[j.prompt_index] = max(best.get(j.prompt_index, 0), j.assembler.num_cached_tokens)
        return sum(best.values())

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(j.assembler.token_ids) for j in self.jobs)

    async def stream(self) -> AsyncIterator[tuple[ChoiceJob, ChoiceDelta]]:
        """Yield every choice's deltas until all are finished; abort leftovers on early exit."""
        try:
            if len(self.jobs) == 1:
                async for item in self._run_job(self.jobs[0]):
                    yield item
            else:
                async for item in self._run_merged():
                    yield item
        finally:
            unfinished = [j for j in self.jobs if not j.assembler.finished]
            if unfinished:
                if self.metrics is not None:  # the client left or a sibling failed: count as aborted
                    now = time.time()
                    for j in unfinished:
                        if j.timer is not None:
                            self.metrics.on_finish(j.timer, "abort", now)
                # Detached: under a cancelled task (client disconnect) awaiting here would be cut.
                _detach(self.client.abort([j.engine_id for j in unfinished]))

    async def run_to_end(self) -> None:
        """Consume the whole generation (non-streaming responses)."""
        async for _ in self.stream():
            pass

    async def admit(self) -> None:
        """Submit every job and wait for each one's first answer, so that a refusal (overload, an
        invalid request, no engine) raises here, before a stream sends its HTTP status: a stream
        never answers 200 and then fails for a reason known at admission. A job's first output is
        kept for ``stream()``. On failure or cancellation every submitted job is closed (aborted)."""

        async def first(job: ChoiceJob) -> None:
            job.agen = self._submit(job)
            try:
                job.first = await job.agen.__anext__()
            except StopAsyncIteration:
                pass

        try:
            results = await asyncio.gather(*(first(j) for j in self.jobs), return_exceptions=True)
        except BaseException:  # cancelled: the client left while waiting
            await self._close_submitted()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._close_submitted()
            raise errors[0]

    async def _close_submitted(self) -> None:
        for job in self.jobs:
            if job.agen is not None:
                agen, job.agen, job.first = job.agen, None, None
                await agen.aclose()

    def _submit(self, job: ChoiceJob) -> Any:
        if self.metrics is not None:
            job.timer = self.metrics.on_request_start(len(job.prompt_token_ids), self.arrival_time)
        kwargs: dict[str, Any] = {"timeout_s": self.timeout_s} if self.timeout_s > 0 else {}
        if self.lora is not None:
            kwargs["lora"] = self.lora
        return self.client.generate(job.engine_id, job.prompt_token_ids, job.params,
                                    priority=self.plans[job.prompt_index].priority, arrival_time=self.arrival_time,
                                    **kwargs)

    async def _outputs(self, job: ChoiceJob, agen: Any) -> AsyncIterator[RequestOutput]:
        if job.first is not None:
            first, job.first = job.first, None
            yield first
        async for out in agen:
            yield out

    async def _run_job(self, job: ChoiceJob) -> AsyncIterator[tuple[ChoiceJob, ChoiceDelta]]:
        agen = job.agen if job.agen is not None else self._submit(job)
        job.agen = None
        try:
            async for out in self._outputs(job, agen):
                delta = self._apply(job, out)
                yield job, delta
                if delta.finish_reason is not None:
                    break
        finally:
            # After a stop-string match the engine request is still live: closing its stream
            # aborts it (EngineClient.generate sends the one Abort from its ``finally``).
            await agen.aclose()

    def _apply(self, job: ChoiceJob, out: RequestOutput) -> ChoiceDelta:
        delta = job.assembler.update(out)
        if self.metrics is not None and job.timer is not None:
            now = time.time()
            if out.queue_time_s is not None:  # the engine sets it on a request's first output only
                self.metrics.on_queue_time(out.queue_time_s)
            self.metrics.on_tokens(job.timer, len(out.new_token_ids), now)
            if delta.finish_reason is not None:
                self.metrics.on_finish(job.timer, delta.finish_reason, now)
        return delta

    async def _run_merged(self) -> AsyncIterator[tuple[ChoiceJob, ChoiceDelta]]:
        # Bounded: a consumer that does not read stops the pumps, so the engine client's per-request
        # buffers fill and hold those requests in the engine (evenflow/frontend/clients/backpressure.py).
        queue: asyncio.Queue = asyncio.Queue(maxsize=_MERGED_PER_JOB * len(self.jobs))
        done = object()

        async def pump(job: ChoiceJob) -> None:
            try:
                async for item in self._run_job(job):
                    await queue.put(item)
                await queue.put(done)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # surfaced to the consumer, which re-raises it
                await queue.put(e)

        tasks = [asyncio.ensure_future(pump(j)) for j in self.jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
