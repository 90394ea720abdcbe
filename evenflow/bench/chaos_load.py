"""Load and accounting of a chaos run: bounded client loops, every request's single outcome,
greedy probes, malformed HTTP bodies and wire frames, /health and /metrics latency."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx
import msgspec
import zmq
import zmq.asyncio

REQUEST_TIMEOUT_S = 90.0  # a request with no end by then is "lost"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly muse".split()
PROBES = ["Once upon a time", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]


def prompt_of(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Ledger:
    """Outcomes: every request sent lands in exactly one of completed/refused/errored/disconnected/lost."""

    sent: int = 0
    completed: int = 0
    refused: int = 0
    errored: int = 0
    disconnected: int = 0  # the client left mid-stream on purpose (the server must free its blocks)
    lost: int = 0
    duplicated: int = 0
    reasons: Counter = field(default_factory=Counter)
    streams: list[list[float]] = field(default_factory=list)  # chunk times of completed streams
    probe_ref: dict[str, str] = field(default_factory=dict)
    probe_ok: int = 0
    probe_mismatch: int = 0
    malformed_http: Counter = field(default_factory=Counter)  # status -> count
    malformed_wire: Counter = field(default_factory=Counter)  # "error reply" / "no reply"
    health_ms: list[float] = field(default_factory=list)
    metrics_ms: list[float] = field(default_factory=list)
    health_fail: int = 0

    def error(self, reason: str) -> None:
        self.errored += 1
        self.reasons[_short(reason)] += 1


def _short(reason: str) -> str:
    reason = reason.replace("the engine is unavailable: ", "")
    return (reason[:70] + "...") if len(reason) > 73 else reason


def _error_message(resp_text: str) -> str:
    try:
        return str(json.loads(resp_text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"no OpenAI error body: {resp_text[:60]!r}"


async def one_request(http: httpx.AsyncClient, url: str, body: dict, ledger: Ledger,
                      disconnect_after: int = 0) -> str | None:
    """Send one completion; record its outcome; return its text when it completed."""
    ledger.sent += 1
    try:
        if not body.get("stream"):
            r = await http.post(url + "/v1/completions", json=body)
            if r.status_code == 503:
                ledger.refused += 1
                return None
            if r.status_code != 200:
                ledger.error(f"HTTP {r.status_code}: {_error_message(r.text)}")
                return None
            choices = r.json()["choices"]
            if any(c["finish_reason"] == "abort" for c in choices):
                ledger.error("finish_reason abort (engine shut down)")
                return None
            ledger.completed += 1
            return "".join(c["text"] for c in choices)
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code == 503:
                await r.aread()
                ledger.refused += 1
                return None
            if r.status_code != 200:
                ledger.error(f"HTTP {r.status_code}: {_error_message((await r.aread()).decode())}")
                return None
            times: list[float] = []
            finishes, done, error, text = [], False, None, []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if done:  # anything after [DONE] is a duplicate answer
                    ledger.duplicated += 1
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"].get("message") or "error event without a message"
                    continue
                times.append(time.monotonic())
                for c in obj["choices"]:
                    text.append(c["text"])
                    if c.get("finish_reason"):
                        finishes.append(c["finish_reason"])
                if disconnect_after and len(times) >= disconnect_after and not finishes:
                    ledger.disconnected += 1
                    return None
            if len(finishes) > 1:
                ledger.duplicated += 1
            if error is not None:
                ledger.error(f"stream error: {error}")
            elif finishes == ["abort"]:
                ledger.error("finish_reason abort (engine shut down)")
            elif len(finishes) == 1 and done:
                ledger.completed += 1
                ledger.streams.append(times)
                return "".join(text)
            else:  # ended without a finish, an error or [DONE]: a silent failure
                ledger.lost += 1
            return None
    except httpx.TimeoutException:
        ledger.lost += 1
    except httpx.TransportError as e:  # a killed frontend cannot explain itself: the socket says it
        ledger.error(f"connection: {type(e).__name__}")
    return None


def probe_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


async def record_probe_references(url: str, ledger: Ledger) -> None:
    """Greedy outputs of the probes on an idle engine: the truth under pressure later."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        for p in PROBES:
            r = await http.post(url + "/v1/completions", json=probe_body(p))
            r.raise_for_status()
            ledger.probe_ref[p] = r.json()["choices"][0]["text"]


async def client_loop(seed: int, urls: Callable[[], list[str]], stop_at: float, ledger: Ledger,
                      long_share: float = 0.15) -> None:
    """One bounded client: mixed prompts and outputs, 70% streams, 10% of streams leave early,
    20% greedy probes compared with their idle references."""
    failures = ledger.refused + ledger.errored
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        while time.monotonic() < stop_at:
            if ledger.refused + ledger.errored > failures:  # refused or failed: back off as a client would
                await asyncio.sleep(0.25)
            failures = ledger.refused + ledger.errored
            url = rng.choice(urls())
            if rng.random() < 0.2 and ledger.probe_ref:
                prompt = rng.choice(PROBES)
                text = await one_request(http, url, probe_body(prompt), ledger)
                if text is not None:
                    if text == ledger.probe_ref[prompt]:
                        ledger.probe_ok += 1
                    else:
                        ledger.probe_mismatch += 1
                continue
            words = rng.choice([4, 30, 120]) if rng.random() > long_share else 350
            body = {"prompt": prompt_of(rng, words), "max_tokens": rng.choice([8, 24, 64]),
                    "stream": rng.random() < 0.7, "temperature": rng.choice([0, 0.8]), "ignore_eos": True}
            leave = rng.randint(2, 5) if body["stream"] and rng.random() < 0.1 else 0
            await one_request(http, url, body, ledger, disconnect_after=leave)


async def burst(urls: list[str], size: int, ledger: Ledger, seed: int) -> None:
    """``size`` requests at once, far above what the engine holds: most must be refused with 503."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=size)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        await asyncio.gather(*(one_request(http, rng.choice(urls), {
            "prompt": prompt_of(rng, 60), "max_tokens": 16, "stream": i % 2 == 0, "ignore_eos": True}, ledger)
            for i in range(size)))


MALFORMED_BODIES = [b"", b"{", b"[]", b"null", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": "many"}',
                    b'{"prompt": "x", "max_tokens": -3}', b'{"prompt": "x", "n": 100000}', b"\xff\xfe\x00garbage",
                    b'{"prompt": "x", "temperature": "hot"}', b'{"messages": 7}', b'{"prompt": "x", "stop": {}}']


async def malformed_http(urls: list[str], seconds: float, ledger: Ledger) -> None:
    """Bad bodies at a high rate: each must get a 4xx with an error body (or 503 while no engine)."""
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=30) as http:
        i = 0
        while time.monotonic() < end:
            body = MALFORMED_BODIES[i % len(MALFORMED_BODIES)]
            path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
            i += 1
            try:
                r = await http.post(urls[i % len(urls)] + path, content=body,
                                    headers={"content-type": "application/json"})
                ok = r.status_code in (400, 413, 503) and "error" in r.json()
                ledger.malformed_http[str(r.status_code) if ok else f"bad {r.status_code}"] += 1
            except (httpx.HTTPError, ValueError) as e:
                ledger.malformed_http[f"bad {type(e).__name__}"] += 1


async def malformed_wire(address: str, seconds: float, ledger: Ledger) -> None:
    """Garbage frames straight at the engine-core's ROUTER: each must get an Error frame back."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frames = [b"\x00", b"\xc1", msgspec.msgpack.encode(["request", "x", [1]]), msgspec.msgpack.encode(["bogus"]),
              msgspec.msgpack.encode({"a": 1}), b"\x93" * 50, msgspec.msgpack.encode(["hello", "v"])]
    end = time.monotonic() + seconds
    i = 0
    try:
        while time.monotonic() < end:
            await sock.send(frames[i % len(frames)])
            i += 1
            if await sock.poll(2000):
                reply = msgspec.msgpack.decode(await sock.recv())
                ledger.malformed_wire["error reply" if reply and reply[0] == "error" else "other reply"] += 1
            else:
                ledger.malformed_wire["no reply (engine down?)"] += 1
            await asyncio.sleep(0.002)
    finally:
        sock.close(0)
        ctx.term()


async def prober(urls: Callable[[], list[str]], stop_at: float, ledger: Ledger) -> None:
    """/health and /metrics every 0.5 s: their latency under load (failures counted apart)."""
    async with httpx.AsyncClient(timeout=10) as http:
        i = 0
        while time.monotonic() < stop_at:
            live = urls()
            url = live[i % len(live)]
            i += 1
            for path, sink in (("/health", ledger.health_ms), ("/metrics", ledger.metrics_ms)):
                t0 = time.perf_counter()
                try:
                    r = await http.get(url + path)
                    if r.status_code == 200:
                        sink.append((time.perf_counter() - t0) * 1000)
                    else:
                        ledger.health_fail += 1
                except httpx.HTTPError:
                    ledger.health_fail += 1
            await asyncio.sleep(0.5)


def metric_value(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))
