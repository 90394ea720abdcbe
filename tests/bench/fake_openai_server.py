"""A tiny OpenAI-compatible streaming server that simulates a token-budget scheduler, for smoke tests.

Each simulated step takes ``step_base_ms + step_per_token_ms * tokens``; decodes go first (one
token each), then prompt chunks fill what is left of ``--max-num-batched-tokens``. It exposes what
the benchmark scripts read: POST /v1/completions (SSE, token-id prompts, ``include_usage``),
GET /v1/models, /health and /metrics with ``evenflow:`` counters. Run:
``python tests/bench/fake_openai_server.py --port P --max-num-batched-tokens N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class SimRequest:
    prompt_left: int
    output_left: int
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)


@dataclass
class SimEngine:
    budget: int
    step_base_s: float
    step_per_token_s: float
    running: list[SimRequest] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    counters: dict[str, float] = field(default_factory=dict)

    async def loop(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            budget, tokens, sampled = self.budget, 0, []
            for r in self.running:
                if r.prompt_left == 0 and budget > 0:
                    budget, tokens = budget - 1, tokens + 1
                    sampled.append(r)
            prompt_tokens = 0
            for r in self.running:
                if r.prompt_left > 0 and budget > 0:
                    chunk = min(r.prompt_left, budget)
                    r.prompt_left -= chunk
                    budget, prompt_tokens = budget - chunk, prompt_tokens + chunk
                    if r.prompt_left == 0:
                        sampled.append(r)
            cost = self.step_base_s + self.step_per_token_s * (tokens + prompt_tokens)
            await asyncio.sleep(cost)
            for r in sampled:
                r.output_left -= 1
                r.tokens.put_nowait(7)
                if r.output_left == 0:
                    r.tokens.put_nowait(None)
                    self.running.remove(r)
            self._count(steps=1, prompt=prompt_tokens, generation=len(sampled), busy=cost)

    def _count(self, steps: int, prompt: int, generation: int, busy: float) -> None:
        for key, value in (
            ("num_steps_total", steps),
            ("prompt_tokens_total", prompt),
            ("generation_tokens_total", generation),
            ("worker_forward_seconds_total", busy),
        ):
            self.counters[key] = self.counters.get(key, 0.0) + value

    def add(self, prompt_len: int, max_tokens: int) -> SimRequest:
        req = SimRequest(prompt_len, max_tokens)
        self.running.append(req)
        self.wake.set()
        return req


def build_app(model: str, engine: SimEngine) -> Starlette:
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return JSONResponse({"error": "prompt must be token ids"}, status_code=400)
        max_tokens = int(body.get("max_tokens", 16))
        sim = engine.add(len(prompt), max_tokens)

        async def events():  # type: ignore[no-untyped-def]
            n = 0
            while (tok := await sim.tokens.get()) is not None:
                n += 1
                finish = "length" if n == max_tokens else None
                chunk = {"id": "x", "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": f" t{tok}", "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def metrics(_: Request) -> PlainTextResponse:
        lines = [f"evenflow:{k} {v}" for k, v in engine.counters.items()]
        usage = min(1.0, sum(r.prompt_left + 1 for r in engine.running) / 10000.0)
        lines += ["evenflow:num_preemptions_total 0", f'evenflow:kv_cache_usage_perc{{engine="0"}} {usage}']
        return PlainTextResponse("\n".join(lines) + "\n")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(engine.loop())
        yield
        task.cancel()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--step-base-ms", type=float, default=3.0)
    parser.add_argument("--step-per-token-ms", type=float, default=0.02)
    args, _unknown = parser.parse_known_args()  # accept and ignore engine flags it does not model
    engine = SimEngine(args.max_num_batched_tokens, args.step_base_ms / 1e3, args.step_per_token_ms / 1e3)
    uvicorn.run(build_app(args.model, engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
