"""What every worker has when the engine-core reports ready: its whole KV cache in memory (the log
says why that size), and OpenMP threads that sleep rather than spin between regions."""

from __future__ import annotations

from pathlib import Path

import psutil

from .harness import start_engine

CACHE_BYTES = 384 * 2**20


def test_the_kv_cache_is_resident_before_ready(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, "--max-model-len", "256", "--max-num-batched-tokens", "64",
                       "--kv-cache-memory", str(CACHE_BYTES))
    try:
        # Read at once: nothing has run since Ready came, so what is resident was written before it.
        rss = sum(psutil.Process(pid).memory_info().rss for pid in eng.worker_pids)
        assert rss >= CACHE_BYTES, f"workers hold {rss / 2**20:.0f} MiB at ready, the cache alone is 384 MiB"
        assert eng.ready is not None and eng.ready.num_kv_blocks > 0
        assert "KV cache of rank 0:" in eng.log() and "--kv-cache-memory 0.38 GiB" in eng.log()
        # Set in the worker before torch loads libgomp (which reads them once, at load).
        assert "OpenMP threads spin briefly, then sleep, between regions (GOMP_SPINCOUNT=10000 KMP_BLOCKTIME=0)" in eng.log()
    finally:
        eng.stop()


def test_the_default_size_is_what_the_scheduler_can_use(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, "--max-model-len", "256", "--max-num-batched-tokens", "64",
                       "--max-num-seqs", "4")
    try:
        assert eng.ready is not None and eng.ready.num_kv_blocks == 4 * 256 // 16
        assert "what max_num_seqs x max_model_len can use (under the cap" in eng.log()
    finally:
        eng.stop()
