"""Smoke tests of the benchmark scripts: their arithmetic, and each script end to end against a fake
OpenAI-compatible server (tests/bench/fake_openai_server.py), a few seconds each, no model."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from evenflow.bench import serving as bench_serving
import pytest
from evenflow.bench.capacity import Probe, search_capacity
from evenflow.bench.contention import wait_env
from evenflow.bench.client import RequestRecord
from evenflow.bench.metrics import MetricsSnapshot, engine_numbers, parse_prometheus
from evenflow.bench.server import ServerConfig, evenflow_argv, peer_problem, vllm_argv
from evenflow.bench.stats import SLO, request_gaps, run_stats
from evenflow.bench.workload import (
    LengthDist,
    add_workload_args,
    fit_lengths,
    poisson_schedule,
    replay_schedule,
    workload_from_args,
)

from tests.bench.conftest import fake_server_cmd, run_script


def _record(kind: str, start: float, times: list[float]) -> RequestRecord:
    return RequestRecord(kind, 8, len(times), start, list(times), len(times), times[-1] if times else start, bool(times))


def test_gaps_never_straddle_two_requests() -> None:
    recs = [_record("a", 0.0, [1.0, 1.1, 1.4]), _record("b", 0.0, [0.5]), _record("a", 0.2, [2.0, 2.05])]
    gaps, worst = request_gaps(recs)
    assert sorted(round(g, 3) for g in gaps) == [0.05, 0.1, 0.3]
    assert [round(w, 3) for w in worst] == [0.3, 0.0, 0.05]


def test_run_stats_groups_and_goodput() -> None:
    recs = [_record("steady", 0.0, [0.1, 0.2, 0.3]), _record("long", 0.0, [1.0, 1.5])]
    stats = run_stats(recs, SLO(ttft_ms=500.0))
    assert set(stats.groups) == {"all", "steady", "long"}
    assert stats.duration_s == pytest.approx(1.5)
    assert stats.groups["steady"].ttft.p50 == pytest.approx(100.0)
    assert stats.groups["long"].itl.max == pytest.approx(500.0)
    assert stats.groups["all"].goodput == pytest.approx(1 / 1.5)  # only the steady one met TTFT <= 500 ms
    assert stats.groups["all"].output_tokens == 5


def test_prometheus_both_prefixes_labels_summed() -> None:
    text = (
        "# HELP x\nevenflow:num_preemptions_total{model_name=\"m\"} 3\n"
        'vllm:prefix_cache_hits_total{engine="0"} 10\nvllm:prefix_cache_hits_total{engine="1"} 5\n'
        "vllm:kv_cache_usage_perc 0.25\nother_metric 9\n"
    )
    values = parse_prometheus(text)
    assert values == {"num_preemptions_total": 3.0, "prefix_cache_hits_total": 15.0, "kv_cache_usage_perc": 0.25}
    before = MetricsSnapshot({"iteration_tokens_total_sum": 100, "iteration_tokens_total_count": 10}, 0.0)
    after = MetricsSnapshot({"iteration_tokens_total_sum": 400, "iteration_tokens_total_count": 20,
                             "prefix_cache_hits_total": 4, "prefix_cache_queries_total": 8}, 2.0)
    nums = engine_numbers(before, after, 0.5)
    assert nums.tokens_per_step == pytest.approx(30.0)
    assert nums.prefix_hit_rate == pytest.approx(0.5)
    assert nums.preemptions is None and nums.target_itl_ms is None


def test_a_moving_target_is_judged_by_its_run_median_not_its_end_value() -> None:
    # A derived target falls once the last long prompt is done: the run's gaps were held to the
    # values before, so the verdict must not read the run against the value at the end.
    before = MetricsSnapshot({"target_itl_seconds": 0.30}, 0.0)
    after = MetricsSnapshot({"target_itl_seconds": 0.25}, 9.0)
    nums = engine_numbers(before, after, None, [0.30, 0.34, 0.41, 0.33, 0.28, 0.25])
    assert nums.target_itl_ms == pytest.approx(315.0)
    assert (nums.target_itl_ms_low, nums.target_itl_ms_high, nums.target_itl_ms_end) == pytest.approx((250, 410, 250))
    # No polls (a run shorter than the interval): the value at the end is all there is.
    assert engine_numbers(before, after, None, []).target_itl_ms == pytest.approx(250.0)


def test_poisson_is_seeded_bounded_and_clipped() -> None:
    dist = LengthDist(median=256, sigma=1.5, low=16, high=4096)
    a = poisson_schedule(2.0, 1000, 30.0, dist, LengthDist(64, 0.0, 1, 512), seed=3)
    b = poisson_schedule(2.0, 1000, 30.0, dist, LengthDist(64, 0.0, 1, 512), seed=3)
    assert a == b and 30 < len(a) < 100  # ~60 arrivals in 30 s
    assert all(16 <= p.prompt_len <= 4096 and p.output_len == 64 and p.arrival_s < 30 for p in a)
    assert len(poisson_schedule(math.inf, 7, 1.0, dist, dist, seed=0)) == 7


def test_replay_and_interference_schedules(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 10, "output_len": 3, "arrival": 100.5}\n{"prompt_len": 20, "output_len": 4, "arrival": 100.0}\n')
    planned = replay_schedule(trace, speed=2.0, num_requests=10, duration_s=60)
    assert [(p.arrival_s, p.prompt_len) for p in planned] == [(0.0, 20), (0.25, 10)]
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    args = parser.parse_args(["--duration", "12", "--long-interval", "5", "--long-first", "1"])
    wl = workload_from_args(args, vocab_size=512)
    assert [p.arrival_s for p in wl.schedule] == [1.0, 6.0, 11.0] and wl.steady and wl.steady.count == 8
    notes = fit_lengths(args, max_model_len=2048)  # defaults: 2048 + 16 long, 4096 + 512 poisson
    assert args.long_prompt_len == 2032 and args.prompt_len_range == "16:1536" and len(notes) == 2


def test_capacity_search_brackets_the_threshold() -> None:
    cap = search_capacity(lambda r: Probe(r, r <= 3.3, 0, 0, 0), start_rate=0.5, max_rate=64, bisect_steps=5)
    assert 3.0 <= cap.rate <= 3.3
    assert [p.rate for p in cap.probes][:4] == [0.5, 1.0, 2.0, 4.0]


def test_peer_problem_without_venv_or_shim_points_at_the_docs(tmp_path: Path) -> None:
    problem = peer_problem(tmp_path / "nope") or ""
    assert "no peer venv" in problem and "docs/peer.md" in problem and "--peer-venv" in problem
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    assert "--peer-shim" in (peer_problem(tmp_path / "venv", tmp_path / "no_shim.py") or "")


def test_peer_venv_and_shim_come_from_flags(tmp_path: Path) -> None:
    from evenflow.bench.launch import add_server_args, server_config, server_spec
    from evenflow.bench.server import DEFAULT_VLLM_SHIM

    assert DEFAULT_VLLM_SHIM.is_file() and DEFAULT_VLLM_SHIM.parent.name == "scripts"  # shipped, not a dev path
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "max_position_embeddings": 256}))
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--model-dir", str(tmp_path), "--peer-venv", "/v", "--peer-shim", "/s/cli.py",
                              "--log-dir", str(tmp_path)])
    spec = server_spec(args, "vllm", server_config(args, 64))
    assert spec.argv[:3] == ["/v/bin/python", "/s/cli.py", "serve"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_server_imports_the_evenflow_the_bench_imported_not_the_working_directorys(tmp_path: Path) -> None:
    """An arm of older code launched from a checkout ran the checkout's code: ``python -m`` puts the
    working directory first on sys.path. A server now runs the evenflow its bench imported."""
    import evenflow
    from evenflow.bench.launch import add_server_args, server_config, server_spec

    checkout = tmp_path / "checkout"
    (checkout / "evenflow").mkdir(parents=True)
    (checkout / "evenflow" / "__init__.py").touch()
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "max_position_embeddings": 256}))
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--model-dir", str(tmp_path), "--log-dir", str(tmp_path)])
    spec = server_spec(args, "evenflow", server_config(args, 64))

    def imported(env: dict[str, str]) -> str:  # -c, like -m, puts the working directory first
        ran = subprocess.run([sys.executable, "-c", "import evenflow; print(evenflow.__file__)"], cwd=checkout,
                             env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
        return ran.stdout.strip()

    assert imported({}) == str(checkout / "evenflow" / "__init__.py")  # the working directory's, without it
    assert imported(spec.env) == str(Path(evenflow.__file__).resolve())  # the bench's, with it
    custom = parser.parse_args(["--model-dir", str(tmp_path), "--log-dir", str(tmp_path), "--server-cmd", "x {port}"])
    assert server_spec(custom, "evenflow", server_config(custom, 64)).env == {}  # a user's command: their env


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_chaos_processes_import_the_evenflow_the_bench_imported(tmp_path: Path) -> None:
    """The chaos and fault benches' processes (chaos_procs.Proc) start as the servers do: a checkout's
    evenflow in their working directory does not shadow the bench's."""
    import evenflow
    from evenflow.bench.chaos_procs import Proc

    checkout = tmp_path / "checkout"
    (checkout / "evenflow").mkdir(parents=True)
    (checkout / "evenflow" / "__init__.py").touch()
    out = tmp_path / "out.txt"
    proc = Proc("probe", ["-c", f"import evenflow; open({str(out)!r}, 'w').write(evenflow.__file__)"],
                tmp_path / "probe.log")
    here = os.getcwd()
    os.chdir(checkout)
    try:
        proc.start()
    finally:
        os.chdir(here)
    assert proc.popen is not None and proc.popen.wait(timeout=60) == 0
    assert out.read_text() == str(Path(evenflow.__file__).resolve())


def test_bench_serving_interference_on_fake_server(fake_server: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    rc = bench_serving.main([
        "--base-url", fake_server, "--workload", "interference", "--duration", "2", "--vocab-size", "512",
        "--steady-streams", "3", "--steady-output-len", "24", "--long-prompt-len", "600",
        "--long-output-len", "4", "--long-interval", "0.7", "--long-first", "0.2", "--slo-itl-ms", "500",
        "--no-progress", "--save-requests", "--out", str(out),
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    groups = data["stats"]["groups"]
    assert groups["long"]["completed"] == 3 and groups["steady"]["completed"] >= 3
    assert groups["all"]["failed"] == 0
    assert groups["steady"]["itl"]["count"] == groups["steady"]["output_tokens"] - groups["steady"]["completed"]
    assert groups["all"]["goodput"] > 0
    assert all(r["output_tokens"] == r["output_len"] for r in data["records"])
    assert abs(data["started_unix_s"] - time.time()) < 60 and all(r["start_s"] >= 0 for r in data["records"])
    assert data["engine"]["steps"] > 0 and data["engine"]["preemptions"] == 0


def test_bench_serving_poisson_on_fake_server(fake_server: str, tmp_path: Path) -> None:
    rc = bench_serving.main([
        "--base-url", fake_server, "--workload", "poisson", "--rate", "20", "--duration", "1",
        "--vocab-size", "512", "--prompt-len-median", "64", "--output-len-median", "8",
        "--shared-prefix-len", "16", "--no-progress", "--out", str(tmp_path / "p.json"),
    ])
    assert rc == 0
    assert json.loads((tmp_path / "p.json").read_text())["stats"]["groups"]["all"]["completed"] > 5


def test_sweep_budget_with_capacity(fake_model_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "sweep"
    proc = run_script("sweep_budget.py", [
        "--model-dir", str(fake_model_dir), "--server-cmd", fake_server_cmd(), "--budgets", "128,unchunked",
        "--targets", "auto", "--duration", "1.0", "--steady-streams", "2", "--steady-output-len", "16", "--long-prompt-len", "800",
        "--long-interval", "0.5", "--long-first", "0.2", "--capacity", "--slo-itl-ms", "1000",
        "--capacity-duration", "0.5", "--capacity-rate-start", "4", "--capacity-max-rate", "8",
        "--capacity-iters", "1", "--prompt-len-median", "32", "--output-len-median", "4", "--no-progress",
        "--out-dir", str(out_dir), "--log-dir", str(tmp_path / "logs"), "--save-requests",
    ])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    points = json.loads((out_dir / "sweep.json").read_text())["points"]
    for label in ("128", "unchunked"):  # each run's records, kept when asked
        records = json.loads((out_dir / f"requests_{label}.json").read_text())["records"]
        assert {r["kind"] for r in records} == {"steady", "long"}
    assert [p["label"] for p in points] == ["128", "unchunked", "target auto"] and points[1]["budget"] == 2048
    assert all(p["capacity"]["rate"] == 8 for p in points)  # the fake server meets a 1 s SLO at 8 req/s
    assert (out_dir / "sweep.png").stat().st_size > 10_000
    assert "unchunked" in (out_dir / "sweep.txt").read_text()


def test_bench_peer_side_by_side(fake_model_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "peer"
    proc = run_script("bench_peer.py", [
        "--model-dir", str(fake_model_dir), "--server-cmd", fake_server_cmd(),
        "--peer-cmd", fake_server_cmd("--step-base-ms 6"), "--budgets", "256", "--workloads", "interference",
        "--duration", "1.2", "--steady-streams", "2", "--steady-output-len", "16", "--long-prompt-len", "300",
        "--long-first", "0.2", "--no-progress", "--out-dir", str(out_dir), "--log-dir", str(tmp_path / "logs"),
        "--rounds", "2",
    ])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = (out_dir / "peer.txt").read_text()
    assert "evenflow" in table and "vllm" in table and "median of 2 rounds" in table
    [tok_s] = [line.split() for line in table.splitlines() if line.startswith("total tok/s")]
    assert len(tok_s) == 2 + 2
    # The fake peer's steps are slower (6 ms base): its throughput ratio to evenflow is below 1 in every round.
    [ratio] = [line.split() for line in table.splitlines() if line.startswith("  total tok/s")]
    assert ratio[2] == "vllm:" and float(ratio[3]) < 1 and all(float(r.strip("[]")) < 1 for r in ratio[4:6])
    [startup] = [line.split() for line in table.splitlines() if line.startswith("start-up s")]
    assert all(float(v) > 0 for v in startup[2:])
    measurements = json.loads((out_dir / "peer.json").read_text())["measurements"]
    # Rounds alternate which engine goes first.
    assert [(m["engine"], m["round"]) for m in measurements] == [
        ("evenflow", 0), ("vllm", 0), ("vllm", 1), ("evenflow", 1)]


def test_bench_peer_without_peer_runs_evenflow_alone(fake_model_dir: Path, tmp_path: Path) -> None:
    proc = run_script("bench_peer.py", [
        "--model-dir", str(fake_model_dir), "--server-cmd", fake_server_cmd(), "--peer-venv", str(tmp_path / "none"),
        "--duration", "0.8", "--steady-streams", "1", "--steady-output-len", "8", "--long-prompt-len", "100",
        "--long-first", "0.1", "--no-progress", "--out-dir", str(tmp_path / "p"), "--log-dir", str(tmp_path / "logs"),
    ])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot run here" in proc.stdout and "measuring without it" in proc.stdout


def test_server_commands_match_across_engines(tmp_path: Path) -> None:
    cfg = ServerConfig(model_dir=tmp_path, budget=None, max_model_len=2048, long_prefill_threshold=128)
    ours, theirs = evenflow_argv(cfg, 8000), vllm_argv(cfg, 8001, tmp_path / "venv")
    flag = lambda argv, name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag(ours, "--max-num-batched-tokens") == flag(theirs, "--max-num-batched-tokens") == "2048"
    assert flag(ours, "--long-prefill-token-threshold") == "0" and "--no-enable-chunked-prefill" in theirs
    small = ServerConfig(model_dir=tmp_path, budget=64, max_model_len=2048)
    assert flag(evenflow_argv(small, 8000), "--max-num-seqs") == "64"
    assert flag(vllm_argv(small, 8000, tmp_path), "--max-num-seqs") == "64"
    derived = ServerConfig(model_dir=tmp_path, budget=None, max_model_len=4096, target_itl_ms="auto")
    assert derived.label == "target auto" and flag(evenflow_argv(derived, 8000), "--target-itl-ms") == "auto"
    assert "--max-num-batched-tokens" not in evenflow_argv(derived, 8000)  # the engine's default ceiling
    assert ServerConfig(model_dir=tmp_path, budget=2048, max_model_len=2048, target_itl_ms="100").label == "target 100 ms"


def test_bench_cpu_kernels_quick() -> None:
    """Both tables print, and the 4-D attention inputs reach the fused kernel (the 3-D ones do not)."""
    proc = run_script("bench_cpu_kernels.py", ["--quick"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.split()[:3] == ["tiny", "1", "8"] for line in lines)
    attention = {line.split("]")[0].strip(): line for line in lines if "D [" in line}
    assert attention["3-D [H, n, D"].endswith("_scaled_dot_product_attention_math")
    assert attention["4-D [1, H, n, D"].endswith("_scaled_dot_product_flash_attention_for_cpu")


def test_bench_dp_routing_smoke(tiny_llama: Path) -> None:
    result = run_script("bench_dp_routing.py", ["--smoke", "--model", str(tiny_llama)], timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [ln for ln in result.stdout.splitlines() if ln.startswith("| ") and "%" in ln]
    assert [r.split("|")[1].strip() for r in rows] == ["prefix", "round_robin", "load"]


def test_engine_specs_serve_one_model_with_one_kv_size(tmp_path: Path) -> None:
    """evenflow-* and llama.cpp serve the GGUF, vLLM the HF folder; every KV cache holds the same tokens."""
    from evenflow.bench.engines import add_engine_args, engine_spec, kv_tokens, parse_engines
    from evenflow.bench.launch import add_server_args, server_config

    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 64, "max_position_embeddings": 4096, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 64}))
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(["--model-dir", str(tmp_path), "--gguf", "/m/model.gguf", "--dtype", "float32",
                              "--vllm-dtype", "bfloat16", "--engines", "evenflow-f32,evenflow-int4,vllm,llama.cpp",
                              "--peer-venv", "/v", "--log-dir", str(tmp_path), "--llama-server", "/b/llama-server"])
    assert parse_engines(args) == ["evenflow-f32", "evenflow-int4", "vllm", "llama.cpp"]
    cfg = server_config(args, 256)
    tokens = kv_tokens(args)
    assert tokens == 2**30 // (2 * 2 * 2 * 16 * 2)  # K and V, 2 layers, 2 KV heads, head_dim 16, bfloat16
    f32, int4, vllm, llama = (engine_spec(args, e, cfg).argv for e in parse_engines(args))
    assert f32[f32.index("--model") + 1] == "/m/model.gguf" and f32[-4:] == ["--dtype", "float32", "--quantization", "none"]
    assert int4[-2:] == ["--dtype", "auto"] and "--quantization" not in int4
    assert f32[f32.index("--num-kv-blocks") + 1] == str(tokens // 16) and f32[f32.index("--max-num-batched-tokens") + 1] == "256"
    assert vllm[3] == str(tmp_path) and vllm[vllm.index("--dtype") + 1] == "bfloat16"
    assert llama[:3] == ["/b/llama-server", "-m", "/m/model.gguf"]
    assert llama[llama.index("-b") + 1] == llama[llama.index("-ub") + 1] == "256"
    assert llama[llama.index("-c") + 1] == str(tokens) and llama[llama.index("-np") + 1] == "10"


def test_contention_settings_export_the_waits_they_name() -> None:
    assert wait_env("auto") == {} and wait_env("2") == {}
    assert wait_env("auto-passive") == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert wait_env("auto-spin") == {"GOMP_SPINCOUNT": "300000"}
    assert wait_env("auto-spin1000") == {"GOMP_SPINCOUNT": "1000"}
