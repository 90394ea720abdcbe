"""KV cache sizing: what the scheduler can use, capped by free memory, the reason said; an explicit
--kv-cache-memory as asked (refused when RAM cannot hold it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evenflow.protocol import WorkerConfig
from evenflow.worker.kv_cache import GIB, CudaMemory, blocks_usable, bytes_per_block, cpu_kv_cache_size, cuda_kv_cache_size
from evenflow.worker.runner import ModelRunner

# SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes = 46080 bytes a token.
SMOL_BLOCK = bytes_per_block(30, 16, 3, 64, torch.float32)


def test_blocks_usable_is_max_num_seqs_full_length_sequences() -> None:
    assert SMOL_BLOCK == 16 * 46080
    assert blocks_usable(1024, 4, 16) == 4 * 64
    assert blocks_usable(1000, 3, 16, lookahead_tokens=8) == 3 * 63  # ceil(1008 / 16)


def test_a_small_model_gets_what_it_can_use_not_a_share_of_ram() -> None:
    usable = blocks_usable(2048, 26, 16)
    size = cpu_kv_cache_size(SMOL_BLOCK, None, 1, usable, available_bytes=20 * GIB)
    assert size.num_blocks == usable  # 2.29 GiB, under the 5 GiB cap
    assert "max_num_seqs x max_model_len" in size.reason and "under the cap" in size.reason


def test_the_cap_is_a_share_of_available_ram_split_over_ranks() -> None:
    usable = blocks_usable(8192, 256, 16)  # 96 GiB
    size = cpu_kv_cache_size(SMOL_BLOCK, None, 2, usable, available_bytes=20 * GIB)
    assert size.num_blocks == int(20 * GIB * 0.25 / 2) // SMOL_BLOCK
    assert size.reason.startswith("capped by 25% of the 20.0 GiB of RAM available / 2 ranks")


def test_explicit_kv_cache_memory_is_taken_as_asked_or_refused() -> None:
    size = cpu_kv_cache_size(SMOL_BLOCK, 1 * GIB, 1, 10, available_bytes=20 * GIB)
    assert size.num_blocks == GIB // SMOL_BLOCK and "--kv-cache-memory 1.00 GiB" in size.reason
    with pytest.raises(ValueError, match="more than the 2.00 GiB of RAM available"):
        cpu_kv_cache_size(SMOL_BLOCK, 3 * GIB, 1, 10, available_bytes=2 * GIB)


def test_cuda_never_takes_more_than_it_can_use() -> None:
    mem = CudaMemory(total=80 * GIB, used=2 * GIB, activation_peak=1 * GIB)
    usable = blocks_usable(2048, 8, 16)
    size = cuda_kv_cache_size(SMOL_BLOCK, mem, None, usable)
    assert size.num_blocks == usable and "under the cap" in size.reason
    assert cuda_kv_cache_size(SMOL_BLOCK, mem, None, 10**9).num_blocks == (72 * GIB - 3 * GIB) // SMOL_BLOCK


def test_the_runner_sizes_by_max_num_seqs_and_max_model_len(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu", block_size=16, max_model_len=128,
                       max_num_seqs=3)
    with caplog.at_level("INFO", logger="evenflow.worker.runner"):
        assert ModelRunner(cfg).determine_num_kv_blocks() == 3 * 8
    assert "KV cache of rank 0: 24 blocks of 16 tokens" in caplog.text and "under the cap" in caplog.text
