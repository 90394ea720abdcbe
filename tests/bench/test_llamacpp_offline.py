"""scripts/bench_llamacpp_offline.py's pieces that run without llama.cpp: the parser of
``llama-batched-bench``'s table (on output the real binary printed: the llama.cpp vendored in the
llama-cpp-python 0.3.36 sdist) and the side-by-side table."""

from __future__ import annotations

from evenflow.bench.llamacpp_offline import SpeedRow, format_rows, parse_batched_bench

# llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -c 2048 -b 2048 -ub 512 -npp 16 -ntg 4 -npl 1,2 -t 1
REAL_OUTPUT = """
llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      4 |    1 |     20 |    1.099 |    14.56 |    0.657 |     6.09 |    1.756 |    11.39 |
|    16 |      4 |    2 |     40 |    3.012 |    10.63 |    1.306 |     6.13 |    4.317 |     9.27 |
"""


def test_batched_bench_rows_give_batch_prefill_and_decode_speed() -> None:
    assert parse_batched_bench(REAL_OUTPUT) == [(1, 14.56, 6.09), (2, 10.63, 6.13)]
    assert parse_batched_bench("main: error: failed to load model\n") == []


def test_side_by_side_table_takes_medians_and_the_decode_ratio() -> None:
    rows = [SpeedRow("llama.cpp", 1, 300.0, 100.0), SpeedRow("evenflow", 1, 1000.0, 50.0),
            SpeedRow("llama.cpp", 1, 340.0, 120.0), SpeedRow("evenflow", 1, 1200.0, 70.0),
            SpeedRow("llama.cpp", 8, 330.0, 200.0), SpeedRow("evenflow", 8, 2000.0, 300.0)]
    lines = format_rows(rows).splitlines()
    assert lines[2] == "| 1 | 320 | 1100 | 110.0 | 60.0 | 0.55 |"
    assert lines[3] == "| 8 | 330 | 2000 | 200.0 | 300.0 | 1.50 |"
