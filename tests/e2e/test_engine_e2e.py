"""engine-core + workers + clients as real processes: greedy equality, liveness, errors, shutdown."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import msgspec
import psutil
import pytest
import zmq

from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.protocol import PROTOCOL_VERSION, AddRequest, Codec, EngineToFrontend, Error, Hello, Outputs, Ready
from evenflow.protocol import SamplingParams
from tests.checkpoints import reference_greedy
from tests.e2e.harness import EngineProcess, start_engine

pytestmark = pytest.mark.slow

BASE_FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
              "--max-frame-bytes", "65536", "--worker-threads", "1")
# Prompts of mixed lengths (chunked prefill: 64-token budget), two sharing a prefix (prefix cache).
# No token 0: reference_greedy passes pad_token_id=0, so transformers would mask it out of the prompt.
PROMPTS = [[1, 5, 9], [(7 * i) % 250 + 3 for i in range(90)], [4] * 20,
           [(7 * i) % 250 + 3 for i in range(70)] + [11, 12], [200, 100, 50, 25, 12, 6], [(i * i) % 255 + 1 for i in range(33)]]
MAX_TOKENS = [12, 8, 20, 10, 16, 9]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(tiny_llama: Path) -> list[list[int]]:
    return [reference_greedy(tiny_llama, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_llama, tmp_path_factory.mktemp("engine"), *BASE_FLAGS, "--num-kv-blocks", "160")
    yield eng
    eng.stop()


async def _collect(client: EngineClient, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = ""
    async for out in client.generate(rid, prompt, sp):
        tokens += out.new_token_ids
        reason = out.finish_reason or reason
    return tokens, reason


async def _run_workload(address: str) -> tuple[list[list[int]], EngineClient]:
    client = EngineClient(address, "workload")
    await client.connect()
    results = await asyncio.gather(*(_collect(client, f"w{i}", p, SamplingParams(max_tokens=n, **GREEDY))
                                     for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))))
    assert all(reason == "length" for _, reason in results)
    return [tokens for tokens, _ in results], client


def test_greedy_matches_transformers_with_overlap(engine: EngineProcess, references: list[list[int]]) -> None:
    async def main() -> None:
        outputs, client = await _run_workload(engine.address)
        stats = (await client.call_utility("get_stats")).result
        await client.close()
        assert outputs == references
        assert stats.scheduler.num_running == 0 and stats.kv_cache.usage == 0.0
        assert stats.kv_cache.prefix_cache_hits > 0  # prompt 3 shares 64 tokens with prompt 1
        assert stats.scheduler.num_steps > 0 and stats.workers.forward_s > 0

    asyncio.run(main())


@pytest.mark.parametrize("flags", [
    pytest.param(("--no-async-scheduling", "--max-model-len", "128", "--num-kv-blocks", "10"),
                 id="no-overlap-preempting"),
    pytest.param(("--tensor-parallel-size", "2", "--max-model-len", "128", "--num-kv-blocks", "10"),
                 id="tp2-overlap-preempting"),
    # The adaptive budget and the partial-prefill bounds change which tokens run when, never which come out.
    pytest.param(("--target-itl-ms", "3", "--max-num-partial-prefills", "2", "--max-long-partial-prefills", "1",
                  "--max-model-len", "128", "--num-kv-blocks", "10"), id="adaptive-budget-partial-prefills-preempting"),
])
def test_greedy_matches_transformers_other_engines(tiny_llama: Path, tmp_path: Path, references: list[list[int]],
                                                   flags: tuple[str, ...]) -> None:
    eng = start_engine(tiny_llama, tmp_path, *BASE_FLAGS, *flags)
    try:
        async def main() -> None:
            outputs, client = await _run_workload(eng.address)
            stats = (await client.call_utility("get_stats")).result
            await client.close()
            assert outputs == references
            # 10 blocks hold 160 tokens; four running requests need 17 blocks: some were preempted.
            assert stats.scheduler.num_preemptions > 0
            adaptive = "--target-itl-ms" in flags  # then every step had a budget chosen for it
            assert (stats.budget.target_itl_s > 0) == adaptive
            assert sum(stats.budget.token_budget_log2_counts) >= (stats.scheduler.num_steps if adaptive else 0)

        asyncio.run(main())
    finally:
        assert eng.stop() == 0, eng.log()


CLIENT_SCRIPT = """
import asyncio, sys
from evenflow.frontend.clients.engine_client import EngineClient
from evenflow.protocol import SamplingParams
async def main():
    c = EngineClient(sys.argv[1], "victim")
    await c.connect()
    async def one(i):
        async for out in c.generate(f"v{i}", [3, 4, 5, i], SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)):
            print("token", i, flush=True)
    await asyncio.gather(*(one(i) for i in range(12)))
asyncio.run(main())
"""


def test_killed_client_frees_its_blocks_while_the_other_streams(engine: EngineProcess, tiny_llama: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, engine.address], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        async def main() -> None:
            client = EngineClient(engine.address, "survivor")
            await client.connect()
            prompt, n = [9, 8, 7, 6], 60
            survivor = asyncio.ensure_future(_collect(client, "s", prompt, SamplingParams(max_tokens=n, **GREEDY)))
            await asyncio.get_running_loop().run_in_executor(None, victim.stdout.readline)  # victim streams
            os.kill(victim.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while True:  # only the survivor's request may hold blocks now
                stats = (await client.call_utility("get_stats")).result
                survivor_blocks = 0 if survivor.done() else math.ceil((len(prompt) + n + 2) / 16)
                if (stats.scheduler.num_running + stats.scheduler.num_waiting <= 1
                        and stats.kv_cache.usage * engine.ready.num_kv_blocks <= survivor_blocks + 1e-9):
                    break
                assert time.monotonic() - t0 < 5.0, f"victim's requests still held: {stats}"
                await asyncio.sleep(0.05)
            tokens, reason = await survivor
            await client.close()
            assert (tokens, reason) == (reference_greedy(tiny_llama, prompt, n), "length")

        asyncio.run(main())
    finally:
        victim.kill()
        victim.wait()


def test_abort_mid_stream_frees_blocks(engine: EngineProcess) -> None:
    async def main() -> None:
        client = EngineClient(engine.address, "aborter")
        await client.connect()
        sp = SamplingParams(max_tokens=400, **GREEDY)
        stream = client.generate("a1", [5, 6, 7], sp)
        async for _ in stream:
            break
        await stream.aclose()  # stopping early aborts in the engine
        reasons = []
        async def explicit() -> None:
            async for out in client.generate("a2", [5, 6, 8], sp):
                if out.finish_reason:
                    reasons.append(out.finish_reason)
                else:
                    await client.abort(["a2"])
        await explicit()
        assert reasons == ["abort"]
        t0 = time.monotonic()
        while ((stats := (await client.call_utility("get_stats")).result).kv_cache.usage > 0
               or stats.scheduler.num_running):
            assert time.monotonic() - t0 < 5.0, stats
            await asyncio.sleep(0.05)
        await client.close()

    asyncio.run(main())


def test_malformed_frames_and_invalid_requests_get_errors(engine: EngineProcess, tiny_llama: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.address)
    codec: Codec[EngineToFrontend] = Codec(EngineToFrontend)

    def ask(frame: bytes) -> EngineToFrontend:
        sock.send(frame)
        while True:
            assert sock.poll(5000)
            reply = codec.decode(sock.recv())
            # An empty Outputs may come at any time: the probe every client gets after any client
            # of this shared engine disconnects (an earlier test's, say). A wire client skips it.
            if not (isinstance(reply, Outputs) and not reply.outputs):
                return reply

    def error_of(frame: bytes) -> Error:
        reply = ask(frame)
        assert isinstance(reply, Error), reply
        return reply

    try:
        assert error_of(codec.encode(Hello(PROTOCOL_VERSION + 1))).code == "version_mismatch"
        assert isinstance(ask(codec.encode(Hello(PROTOCOL_VERSION, "raw"))), Ready)
        assert error_of(os.urandom(64)).code == "bad_frame"
        assert error_of(msgspec.msgpack.encode(["launch_missiles", 1])).code == "bad_frame"
        not_a_list = error_of(msgspec.msgpack.encode(["request", "r", "not a list"]))  # the id is readable
        assert (not_a_list.code, not_a_list.request_id) == ("invalid_request", "r")
        assert not_a_list.message.startswith("prompt_token_ids")
        assert error_of(b"\x00" * 70000).code == "bad_frame"  # over --max-frame-bytes 65536
        neg = error_of(codec.encode(AddRequest("n", [1, 2], SamplingParams(max_tokens=-1))))
        assert (neg.code, neg.request_id) == ("invalid_request", "n") and "max_tokens" in neg.message
        oov = error_of(codec.encode(AddRequest("o", [1, 256])))
        assert oov.code == "invalid_request" and "256" in oov.message
        long = error_of(codec.encode(AddRequest("l", [1] * 500, SamplingParams(max_tokens=20))))
        assert "500" in long.message and "512" in long.message
        sp = SamplingParams(max_tokens=40, **GREEDY)
        sock.send(codec.encode(AddRequest("ok", [1, 5, 9], sp)))
        sock.send(codec.encode(AddRequest("ok", [1, 5, 9], sp)))  # while the first is live
        tokens, errors, reason = [], [], None
        while reason is None:  # the engine kept serving: the valid request completes
            assert sock.poll(10000)
            msg = codec.decode(sock.recv())
            if isinstance(msg, Error):
                errors.append(msg)
                continue
            for out in msg.outputs:
                tokens += out.new_token_ids
                reason = out.finish_reason
        assert [(e.code, e.request_id) for e in errors] == [("duplicate_request_id", "ok")]
        assert tokens == reference_greedy(tiny_llama, [1, 5, 9], 40)
    finally:
        sock.close(0)
        ctx.term()


def test_worker_death_fails_every_client_and_exits_nonzero(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, *BASE_FLAGS, "--num-kv-blocks", "64")
    try:
        async def main() -> None:
            clients = [EngineClient(eng.address, f"c{i}") for i in range(2)]
            for c in clients:
                await c.connect()
            sp = SamplingParams(max_tokens=480, **GREEDY)
            streams = [asyncio.ensure_future(_collect(c, "x", [3, 1, 4], sp)) for c in clients]
            await asyncio.sleep(0.3)
            os.kill(eng.worker_pids[0], signal.SIGKILL)
            t0 = time.monotonic()
            for s in streams:
                with pytest.raises(EngineError) as info:
                    await asyncio.wait_for(s, 10)
                assert info.value.code == "worker_died" and "rank 0" in info.value.message
                assert "SIGKILL" in info.value.message
            assert time.monotonic() - t0 < 10
            for c in clients:
                await c.close()

        asyncio.run(main())
        eng.proc.wait(10)
        assert eng.proc.returncode not in (0, None), eng.log()
    finally:
        eng.stop()


def test_sigterm_aborts_requests_and_exits_zero(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, *BASE_FLAGS, "--num-kv-blocks", "64")
    try:
        async def main() -> None:
            client = EngineClient(eng.address, "c")
            await client.connect()
            stream = asyncio.ensure_future(_collect(client, "x", [3, 1, 4], SamplingParams(max_tokens=480, **GREEDY)))
            await asyncio.sleep(0.3)
            eng.proc.send_signal(signal.SIGTERM)
            tokens, reason = await asyncio.wait_for(stream, 10)
            assert reason == "abort" and 0 < len(tokens) < 480
            await client.close()

        asyncio.run(main())
        assert eng.proc.wait(10) == 0, eng.log()
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in eng.worker_pids)
    finally:
        eng.stop()


def test_spec_only_wire_client_streams_greedy_tokens(engine: EngineProcess, tiny_llama: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "wire_client.py"
    assert "import evenflow" not in script.read_text() and "from evenflow" not in script.read_text()
    run = subprocess.run([sys.executable, str(script), "--engine", engine.address, "--prompt", "1", "5", "9",
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert [int(t) for t in run.stdout.split()] == reference_greedy(tiny_llama, [1, 5, 9], 8)
    assert "finished: length" in run.stderr


def test_spec_only_wire_client_checks_every_rule_of_the_readme(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, *BASE_FLAGS, "--num-kv-blocks", "64", "--client-timeout", "1")
    script = Path(__file__).resolve().parents[2] / "scripts" / "wire_client.py"
    try:
        run = subprocess.run([sys.executable, str(script), "--engine", eng.address, "--check", "--client-timeout",
                              "1"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == 13 and all(line.startswith("ok ") for line in lines), run.stdout
    finally:
        eng.stop()


def test_workers_exit_when_the_engine_core_is_killed(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, *BASE_FLAGS, "--num-kv-blocks", "64")
    try:
        eng.proc.kill()
        eng.proc.wait()
        deadline = time.monotonic() + 5
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in eng.worker_pids):
            assert time.monotonic() < deadline, "workers outlived their engine-core"
            time.sleep(0.1)
    finally:
        eng.stop()


def test_worker_start_failure_is_reported_with_its_cause(tmp_path: Path) -> None:
    model = tmp_path / "gpt2ish"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 50, "n_positions": 64}')
    proc = subprocess.run([sys.executable, "-m", "evenflow.core", "--model", str(model), "--listen",
                           f"ipc://{tmp_path}/e.sock", "--load-format", "dummy"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "worker rank 0 failed" in proc.stderr and "GPT2LMHeadModel" in proc.stderr


def test_client_whose_loop_stalled_is_dropped_then_recovers(engine: EngineProcess, tiny_llama: Path) -> None:
    async def main() -> None:
        client = EngineClient(engine.address, "stalls")
        await client.connect()
        time.sleep(5.5)  # a synchronous caller blocks the loop past the engine's 3 s client timeout
        tokens, reason = await _collect(client, "after-stall", [1, 5, 9], SamplingParams(max_tokens=8, **GREEDY))
        assert (tokens, reason) == (reference_greedy(tiny_llama, [1, 5, 9], 8), "length")
        await client.close()

    asyncio.run(main())


def test_listen_address_in_use_is_a_clear_start_up_error(tiny_llama: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "evenflow.core", "--model", str(tiny_llama), "--listen",
                               f"tcp://127.0.0.1:{port}", *BASE_FLAGS, "--num-kv-blocks", "64"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "start-up failed" in proc.stderr and "Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
