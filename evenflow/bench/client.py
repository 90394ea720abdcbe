"""A low-overhead streaming client for OpenAI-compatible ``/v1/completions`` (evenflow, vLLM, ...).

aiohttp rather than httpx: its line reader and connection pool cost less CPU per chunk, and on a
2-core machine the client shares the cores with the server, so every microsecond here is stolen
from the engine. Each SSE chunk that carries a choice counts as one token event; its arrival time
(``time.perf_counter``) is all that is kept per chunk, and the statistics are computed afterwards
with numpy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: msgspec.Raw | None = None  # servers report failures mid-stream as {"error": {...}}


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass
class RequestRecord:
    """What one request did. Times are seconds since the run started (``perf_counter`` based)."""

    kind: str
    prompt_len: int
    output_len: int  # tokens asked for
    start_s: float
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with a choice
    output_tokens: int = 0  # from the final usage chunk, else the number of chunks
    end_s: float = 0.0
    ok: bool = False
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start_s if self.token_times else None


class CompletionClient:
    """Streams completions from ``base_url`` with token-id prompts and ``ignore_eos``."""

    def __init__(self, base_url: str, model: str, request_timeout_s: float = 600.0) -> None:
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> CompletionClient:
        # No pool limit: every concurrent request gets its own connection, as real clients would.
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def complete(self, prompt_ids: list[int], max_tokens: int, kind: str, t0: float) -> RequestRecord:
        """Send one streaming request and record the arrival time of every chunk; never raises."""
        assert self._session is not None, "use CompletionClient as an async context manager"
        body = {
            "model": self._model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rec = RequestRecord(kind, len(prompt_ids), max_tokens, time.perf_counter() - t0)
        times = rec.token_times
        usage_tokens = -1
        try:
            async with self._session.post(self._url, json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return rec
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    now = time.perf_counter() - t0
                    chunk = _decode_chunk(payload)
                    if chunk.choices:
                        times.append(now)
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
                    if chunk.error is not None:
                        rec.error = "stream error: " + bytes(chunk.error).decode(errors="replace")[:200]
            rec.output_tokens = usage_tokens if usage_tokens >= 0 else len(times)
            rec.ok = rec.output_tokens > 0 and not rec.error
            if rec.output_tokens == 0 and not rec.error:
                rec.error = "no tokens streamed"
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
        except asyncio.CancelledError:
            # The runner cancels what is still streaming at the drain deadline; the partial record
            # is the answer it wants (the request counts as failed), so the cancel ends here.
            rec.error = "cancelled at the drain deadline"
        finally:
            rec.end_s = time.perf_counter() - t0
        return rec


@dataclass(frozen=True)
class ModelInfo:
    """What ``/v1/models`` says about the first model served."""

    id: str
    max_model_len: int | None


async def fetch_model_info(base_url: str) -> ModelInfo:
    """The first model the server lists at ``/v1/models`` (vLLM and evenflow add max_model_len)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            data = await resp.json()
    card = data["data"][0]
    max_len = card.get("max_model_len")
    return ModelInfo(str(card["id"]), int(max_len) if max_len else None)
