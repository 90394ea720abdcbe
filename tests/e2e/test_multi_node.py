"""Tensor parallel across two "hosts" on loopback: an engine-core with rank 0 and a headless
launcher with rank 1, joined through torch.distributed and the secured TCP links. Greedy outputs
equal tensor parallel 1 and transformers; killing the second host ends the engine-core with the
cause, which the client hears; pausing either host (SIGSTOP) is a slow step that loses no token;
killing the engine-core ends the headless host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from evenflow.frontend.clients.engine_client import BlockingEngineClient, EngineError
from evenflow.protocol import SamplingParams
from evenflow.protocol.link_auth import SECRET_ENV
from tests.checkpoints import reference_greedy
from tests.e2e.harness import start_engine
from tests.ports import loopback_ports

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--num-kv-blocks", "64", "--worker-threads", "1")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 9, 100, 4, 8], list(range(1, 40))]


def _generate(client: BlockingEngineClient, rid: str, prompt: list[int]) -> list[int]:
    return [t for out in client.generate(rid, prompt, GREEDY) for t in out.new_token_ids]


def test_two_hosts_match_tp1_and_a_lost_host_stops_the_engine(tiny_llama: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "loopback-test-secret-0123456789")
    port = loopback_ports(3)
    nodes = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    host1_log = open(tmp_path / "host1.log", "wb")
    host1 = subprocess.Popen([sys.executable, "-m", "evenflow.core", "--model", str(tiny_llama), *FLAGS, *nodes,
                              "--node-rank", "1", "--headless"], stdout=host1_log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
    engines = []
    try:
        engines.append(start_engine(tiny_llama, tmp_path, *FLAGS, name="tp1"))
        try:
            engines.append(start_engine(tiny_llama, tmp_path, *FLAGS, *nodes, "--node-rank", "0", name="host0"))
        except RuntimeError as e:  # the other host's side of a start-up that never met (seen once in CI, not alone)
            tail = (tmp_path / "host1.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{e}\nhost1 (headless, exit code {host1.poll()}):\n{tail}") from e
        tp1, host0 = engines
        ref_client = BlockingEngineClient(tp1.address, "tp1")
        ref_client.connect(timeout=10)
        client = BlockingEngineClient(host0.address, "two-hosts")
        client.connect(timeout=10)
        for i, prompt in enumerate(PROMPTS):
            got = _generate(client, f"p{i}", prompt)
            assert got == _generate(ref_client, f"p{i}", prompt) == reference_greedy(tiny_llama, prompt, 12)
        ref_client.close()
        assert "127.0.0.1:%d" % (port + 1) in host0.log()  # the links are on the named address only

        host1.send_signal(signal.SIGKILL)  # the second host dies while the engine-core is idle
        assert host0.proc.wait(timeout=20) == 1
        assert "lost a worker host" in host0.log()
        with pytest.raises(EngineError) as info:
            _generate(client, "after", PROMPTS[0])
        assert info.value.code in ("worker_died", "engine_dead")
        client.close()
    finally:
        for eng in engines:
            eng.stop()
        if host1.poll() is None:
            host1.kill()
        host1.wait()
        host1_log.close()


def test_paused_hosts_lose_nothing_and_a_headless_host_leaves_when_the_engine_core_is_gone(tiny_llama: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "loopback-test-secret-0123456789")
    port = loopback_ports(3)
    nodes = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    host1_log_path = tmp_path / "host1.log"
    with open(host1_log_path, "wb") as host1_log:
        host1 = subprocess.Popen([sys.executable, "-m", "evenflow.core", "--model", str(tiny_llama), *FLAGS, *nodes,
                                  "--node-rank", "1", "--headless"], stdout=host1_log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    host0 = None
    try:
        host0 = start_engine(tiny_llama, tmp_path, *FLAGS, *nodes, "--node-rank", "0", name="host0")
        client = BlockingEngineClient(host0.address, "paused")
        client.connect(timeout=10)
        # Stalls are not deaths across hosts: the engine-core, then the headless host's worker, paused
        # mid-stream for 6 s, past the link's grace (ZMQ's heartbeats, answered by the process, dropped
        # the links after 5 s and the steps published meanwhile were lost: a hang).
        headless_worker = psutil.Process(host1.pid).children(recursive=True)[0].pid
        for pid in (host0.proc.pid, headless_worker):
            tokens: list[int] = []
            for out in client.generate(f"paused-{pid}", PROMPTS[1], LONG):
                if not tokens:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(6.0, os.kill, (pid, signal.SIGCONT)).start()
                tokens += out.new_token_ids
            assert tokens == reference_greedy(tiny_llama, PROMPTS[1], LONG.max_tokens)
            assert host1.poll() is None
        assert "lost" not in host0.log()
        client.close()
        host0.proc.send_signal(signal.SIGKILL)  # its worker follows it (it dies with its parent)
        host0.proc.wait()
        # The link stays down past the grace (LinkState): the headless rank, then its launcher, exit.
        assert host1.wait(timeout=60) != 0
        assert "lost the engine-core" in host1_log_path.read_text(errors="replace")
    finally:
        if host0 is not None:
            host0.stop()
        if host1.poll() is None:
            host1.kill()
        host1.wait()
