"""What chunking one prompt's prefill costs: the prompt alone, prefilled at a fixed chunk size, against
the same prompt in one step.

The model runner is driven directly (no scheduler, no processes): a new request with its first chunk,
then one cached-request step per further chunk, exactly the steps the scheduler sends a lone prompt.
For a model folder the weights are random (``load_format="dummy"``: the cost of a step does not depend
on their values), and the model's ``max_position_embeddings`` is raised to the longest prompt in a copy of
its config.json, so a demo model's 2048-position limit does not cap the lengths measured. A GGUF file is
loaded as ``evenflow serve --model FILE.gguf`` loads it (its Q4 projections kept 4-bit where the start-up
measurement finds that faster: the kernels a served chunk runs on); past its context length its positions
are ones it was not trained on, which costs the same.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from evenflow.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, WorkerConfig
from evenflow.protocol.gguf_file import is_gguf_path
from evenflow.worker.runner import ModelRunner

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefillTiming:
    """One prompt length at one chunk size (``chunk`` None: unchunked), best of the repeats."""

    prompt_len: int
    chunk: int | None
    seconds: float
    steps: int


def config_copy_for_length(model_dir: str, max_len: int) -> Path:
    """A folder holding ``model_dir``'s config.json with room for ``max_len`` positions (a temp dir:
    the caller removes it)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings", 0)), max_len)
    config.pop("quantization_config", None)  # a GGUF-converted folder: the copy has random weights anyway
    out = Path(tempfile.mkdtemp(prefix="chunk_overhead_"))
    (out / "config.json").write_text(json.dumps(config))
    return out


class LonePrefill:
    """Prefills one prompt at a time through a ``ModelRunner``, in chunks of a given size."""

    def __init__(self, model: str, max_len: int, max_chunk: int, dtype: str) -> None:
        if is_gguf_path(model):
            self.folder, source, load_format = None, model, "auto"
        else:
            self.folder = config_copy_for_length(model, max_len + 1)
            source, load_format = str(self.folder), "dummy"
        self.max_len = max_len + 1
        self.num_blocks = -(-self.max_len // BLOCK_SIZE) + 1
        self.runner = ModelRunner(WorkerConfig(
            model=source, dtype=dtype, device="cpu", block_size=BLOCK_SIZE, max_model_len=self.max_len,
            num_kv_blocks=self.num_blocks, max_num_seqs=1, max_num_batched_tokens=min(max_chunk, self.max_len),
            load_format=load_format, num_threads=1, attention_backend="torch"))
        self.runner.init_kv_cache(self.num_blocks)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.step_id = 0

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self, scheduled: dict[str, int], new: list[NewRequestData], cached: list[CachedRequestData],
             finished: list[str]) -> None:
        self.runner.execute_model(SchedulerOutput(self.step_id, new, cached, scheduled, sum(scheduled.values()),
                                                  finished_req_ids=finished))
        self.step_id += 1

    def prefill(self, prompt_len: int, chunk: int | None) -> tuple[float, int]:
        """CPU seconds of this thread (every step's input building, forward and sampling) and steps to
        prefill ``prompt_len`` tokens in chunks of ``chunk`` (None: one step). With one torch thread
        the whole step runs on this thread, and its CPU time does not count the time the machine's
        other processes held the core: the figure a shared machine can still measure."""
        req_id = f"p{self.step_id}"
        prompt = [3 + (7 * j) % 200 for j in range(prompt_len)]
        blocks = list(range(1, -(-(prompt_len + 1) // BLOCK_SIZE) + 1))
        size = prompt_len if chunk is None else chunk
        done = steps = 0
        start = time.thread_time()
        while done < prompt_len:
            n = min(size, prompt_len - done)
            if done == 0:
                new = [NewRequestData(req_id, prompt, self.params, blocks, 0)]
                self._run({req_id: n}, new, [], [])
            else:
                self._run({req_id: n}, [], [CachedRequestData(req_id, [], done)], [])
            done += n
            steps += 1
        seconds = time.thread_time() - start
        self._run({}, [], [], [req_id])
        return seconds, steps


def measure(model: str, prompt_lens: list[int], chunks: list[int | None], repeats: int,
            dtype: str = "float32") -> list[PrefillTiming]:
    """Every (length, chunk) pair, best of ``repeats``; within a repeat the chunk sizes run in turn, the
    order reversed every other repeat (a shared machine's slow spell then hits every size alike)."""
    longest = max(prompt_lens)
    largest = max([c for c in chunks if c is not None] + [longest])
    bench = LonePrefill(model, longest, largest, dtype)
    try:
        bench.prefill(min(256, longest), 64)  # warm-up: kernels, allocator
        timings: list[PrefillTiming] = []
        for prompt_len in prompt_lens:
            best: dict[int | None, float] = {}
            steps: dict[int | None, int] = {}
            for r in range(repeats):
                for chunk in (chunks if r % 2 == 0 else chunks[::-1]):
                    seconds, steps[chunk] = bench.prefill(prompt_len, chunk)
                    best[chunk] = min(best.get(chunk, float("inf")), seconds)
            timings += [PrefillTiming(prompt_len, c, best[c], steps[c]) for c in chunks]
        return timings
    finally:
        bench.close()


def overhead_table(timings: list[PrefillTiming]) -> str:
    """Markdown: per prompt length, each chunk size's time and its overhead over unchunked."""
    chunks = list(dict.fromkeys(t.chunk for t in timings))
    head = "| prompt | " + " | ".join("unchunked" if c is None else str(c) for c in chunks) + " |"
    lines = [head, "|--:|" + "--:|" * len(chunks)]
    for prompt_len in dict.fromkeys(t.prompt_len for t in timings):
        row = {t.chunk: t for t in timings if t.prompt_len == prompt_len}
        base = row[None].seconds if None in row else statistics.median(t.seconds for t in row.values())
        cells = []
        for c in chunks:
            t = row[c]
            cells.append(f"{t.seconds:.2f} s" if c is None else f"{t.seconds:.2f} s ({100 * (t.seconds / base - 1):+.1f}%)")
        lines.append(f"| {prompt_len} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
