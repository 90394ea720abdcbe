"""scripts/bench_chunked_prefill.py's measurement (evenflow/bench/chunk_overhead.py): one prompt alone, in
chunks of each size, on a folder's random weights or a GGUF file's own."""

from __future__ import annotations

from pathlib import Path

import gguf

from evenflow.bench.chunk_overhead import LonePrefill, measure, overhead_table
from tests.gguf_files import write_gguf


def test_each_chunk_size_takes_its_steps_and_the_table_prices_them_against_unchunked(tiny_llama: Path) -> None:
    timings = measure(str(tiny_llama), [100, 700], [32, None], repeats=1)
    steps = {(t.prompt_len, t.chunk): t.steps for t in timings}
    # 700 tokens: past the folder's 512 positions (the copy's config makes room)
    assert steps == {(100, 32): 4, (100, None): 1, (700, 32): 22, (700, None): 1}
    assert all(t.seconds > 0 for t in timings)
    table = overhead_table(timings)
    assert table.splitlines()[0] == "| prompt | 32 | unchunked |"
    assert "| 700 | " in table and "%)" in table


def test_a_gguf_file_runs_on_its_own_weights_as_served_even_past_its_context(tiny_llama: Path,
                                                                             tmp_path: Path) -> None:
    path = str(write_gguf(tiny_llama, tmp_path / "tiny-q4_1.gguf", gguf.GGMLQuantizationType.Q4_1))
    bench = LonePrefill(path, 600, 600, "auto")
    try:
        assert bench.folder is None  # nothing copied: the file's config and weights
        assert bench.runner.model_config.max_position_embeddings == 512  # its own
        assert (bench.runner.config.load_format, bench.runner.config.dtype) == ("auto", "auto")  # as served
        seconds, steps = bench.prefill(100, 48)
        assert steps == 3 and seconds > 0
        assert bench.prefill(600, None)[1] == 1  # 601 positions of a 512-position model
    finally:
        bench.close()
