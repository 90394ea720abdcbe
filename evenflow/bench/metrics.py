"""The engine's own numbers, scraped from its Prometheus ``/metrics`` (``evenflow:`` or ``vllm:``).

Counters are read before and after a run and differenced; gauges are polled during the run: the
KV-cache usage for its peak, the adaptive budget's target for the values it took (a derived target
moves with the load, so the value at the end need not be the one the run's gaps were held to).
Names are matched without their prefix, so one reader serves evenflow and vLLM; labelled series of
one name are summed.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp

PREFIXES = ("evenflow:", "vllm:")

# Each derived number is looked up under the first of these (prefix-less) names that exists.
PREEMPTIONS = ("num_preemptions_total", "num_preemptions")
PREFIX_HITS = ("prefix_cache_hits_total", "prefix_cache_hits")
PREFIX_QUERIES = ("prefix_cache_queries_total", "prefix_cache_queries")
KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")
GEN_TOKENS = ("generation_tokens_total",)
PROMPT_TOKENS = ("prompt_tokens_total",)
# Scheduler steps: evenflow's step counter, or vLLM's per-step token histogram count.
STEPS = ("num_steps_total", "engine_steps_total", "iteration_tokens_total_count")
STEP_TOKENS = ("iteration_tokens_total_sum", "scheduled_tokens_total")
# Seconds the model spent in forward passes (for a busy fraction), where the engine exposes it.
BUSY_SECONDS = ("worker_forward_seconds_total", "model_forward_seconds_total", "model_forward_time_seconds_sum")
# evenflow's adaptive budget (--target-itl-ms).
BUDGET_SUM, BUDGET_COUNT = ("token_budget_tokens_sum",), ("token_budget_tokens_count",)
TARGET_STEPS, TARGET_WITHIN = ("target_steps_total",), ("target_steps_within_total",)
PREDICTED_S, MEASURED_S = ("step_time_predicted_seconds_total",), ("step_time_measured_seconds_total",)
TARGET_ITL_S = ("target_itl_seconds",)  # a gauge: the target in use now (derived or given)


@dataclass
class MetricsSnapshot:
    """Prefix-less metric name -> value (labelled series summed), taken at ``time_s``."""

    values: dict[str, float]
    time_s: float

    def first(self, names: tuple[str, ...]) -> float | None:
        for name in names:
            if name in self.values:
                return self.values[name]
        return None


@dataclass
class EngineNumbers:
    """What the engine itself reports for one run; None where the server does not expose it."""

    preemptions: float | None
    prefix_cache_hits: float | None
    prefix_cache_queries: float | None
    prefix_hit_rate: float | None
    kv_usage_peak: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    steps: float | None
    tokens_per_step: float | None
    busy_fraction: float | None
    mean_token_budget: float | None = None  # the adaptive budget's choices
    within_target_share: float | None = None  # of its planned steps, measured within the target
    measured_over_predicted: float | None = None
    target_itl_ms: float | None = None  # the target in force through the run: the median of its samples (0: fixed)
    target_itl_ms_low: float | None = None  # the lowest and highest sample, and the value at the end
    target_itl_ms_high: float | None = None
    target_itl_ms_end: float | None = None


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each ``evenflow:``/``vllm:`` metric, keyed by its name minus the prefix."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        prefix = next((p for p in PREFIXES if line.startswith(p)), None)
        if prefix is None:
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[len(prefix) : brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line[len(prefix) :].partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if prefix == "evenflow:" and 'engine="' in line:
            continue  # evenflow's data-parallel breakdown: the unlabelled series is already the total
        out[name] = out.get(name, 0.0) + value
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> MetricsSnapshot | None:
    """One scrape of ``/metrics``; None when the server has none or does not answer."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return MetricsSnapshot(parse_prometheus(text), time.perf_counter())


class MetricsWatcher:
    """Scrapes once at start, every ``interval_s`` while running (for gauge peaks), once at stop."""

    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self._base_url = base_url
        self._interval_s = interval_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.before: MetricsSnapshot | None = None
        self.after: MetricsSnapshot | None = None
        self.kv_usage_peak: float | None = None
        self.target_samples_s: list[float] = []  # the target at each poll during the run and at stop

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self.before = await scrape(self._session, self._base_url)
        if self.before is not None:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        assert self._session is not None
        while True:
            await asyncio.sleep(self._interval_s)
            snap = await scrape(self._session, self._base_url)
            if snap is not None:
                self._note_gauges(snap)

    def _note_gauges(self, snap: MetricsSnapshot) -> None:
        usage = snap.first(KV_USAGE)
        if usage is not None:
            self.kv_usage_peak = usage if self.kv_usage_peak is None else max(self.kv_usage_peak, usage)
        target = snap.first(TARGET_ITL_S)
        if target is not None:
            self.target_samples_s.append(target)

    async def stop(self) -> EngineNumbers:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            self.after = await scrape(self._session, self._base_url)
            await self._session.close()
        if self.after is not None:
            self._note_gauges(self.after)
        return engine_numbers(self.before, self.after, self.kv_usage_peak, self.target_samples_s)


def engine_numbers(
    before: MetricsSnapshot | None, after: MetricsSnapshot | None, kv_usage_peak: float | None,
    target_samples_s: list[float] | None = None,
) -> EngineNumbers:
    """Counter differences over the run, and the derived rates. The target is summed up by its samples
    (polls at a fixed interval: the target was above their median for about half the run, below for the rest)."""

    def delta(names: tuple[str, ...]) -> float | None:
        if before is None or after is None:
            return None
        a, b = after.first(names), before.first(names)
        return None if a is None else a - (b or 0.0)

    hits, queries = delta(PREFIX_HITS), delta(PREFIX_QUERIES)
    gen, prompt, steps = delta(GEN_TOKENS), delta(PROMPT_TOKENS), delta(STEPS)
    step_tokens = delta(STEP_TOKENS)
    if step_tokens is None and gen is not None and prompt is not None:
        step_tokens = gen + prompt
    busy = delta(BUSY_SECONDS)
    elapsed = (after.time_s - before.time_s) if (before and after) else None

    targets = list(target_samples_s or [])
    if after is not None and not targets and after.first(TARGET_ITL_S) is not None:
        targets = [after.first(TARGET_ITL_S)]

    def ratio(num: tuple[str, ...], den: tuple[str, ...]) -> float | None:
        a, b = delta(num), delta(den)
        return a / b if a is not None and b else None

    return EngineNumbers(
        preemptions=delta(PREEMPTIONS),
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        prefix_hit_rate=(hits / queries) if (hits is not None and queries) else None,
        kv_usage_peak=kv_usage_peak,
        generation_tokens=gen,
        prompt_tokens=prompt,
        steps=steps,
        tokens_per_step=(step_tokens / steps) if (step_tokens is not None and steps) else None,
        busy_fraction=(busy / elapsed) if (busy is not None and elapsed) else None,
        mean_token_budget=ratio(BUDGET_SUM, BUDGET_COUNT),
        within_target_share=ratio(TARGET_WITHIN, TARGET_STEPS),
        measured_over_predicted=ratio(MEASURED_S, PREDICTED_S),
        target_itl_ms=1e3 * statistics.median(targets) if targets else None,
        target_itl_ms_low=1e3 * min(targets) if targets else None,
        target_itl_ms_high=1e3 * max(targets) if targets else None,
        target_itl_ms_end=1e3 * targets[-1] if targets else None,
    )
