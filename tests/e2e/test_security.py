"""Security of the engine link and the tree: loopback by default, CURVE keys, nothing that runs
received data as code."""

from __future__ import annotations

import asyncio
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evenflow.core.engine_config import ConfigError, config_from_args
from evenflow.frontend.cli import frontend_parser, keygen_main
from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.protocol import SamplingParams
from evenflow.protocol.curve import is_loopback
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_loopback_is_the_default_and_remote_must_be_asked_for(tiny_llama: Path) -> None:
    for addr in ("tcp://127.0.0.1:7100", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x.sock"):
        assert is_loopback(addr)
    for addr in ("tcp://0.0.0.0:7100", "tcp://*:7100", "tcp://10.0.0.5:7100", "tcp://example.com:7100"):
        assert not is_loopback(addr)
        with pytest.raises(ConfigError, match="--allow-remote"):
            config_from_args(["--model", str(tiny_llama), "--listen", addr])
    cfg = config_from_args(["--model", str(tiny_llama), "--listen", "tcp://0.0.0.0:7100", "--allow-remote"])
    assert cfg.allow_remote and cfg.curve_keys is None
    assert config_from_args(["--model", str(tiny_llama)]).listen.startswith("tcp://127.0.0.1:")
    with pytest.raises(ConfigError, match="keygen"):
        config_from_args(["--model", str(tiny_llama), "--curve-keys", str(ROOT / "no-such-dir")])


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENFLOW_API_KEY", "from-env")
    assert frontend_parser().parse_args([]).api_key == "from-env"
    assert frontend_parser().parse_args(["--api-key", "flag"]).api_key == "flag"


def test_an_open_port_without_a_key_is_warned_about() -> None:
    from evenflow.frontend.cli import open_port_warning

    assert "without an API key" in open_port_warning("0.0.0.0", None)  # type: ignore[operator]
    assert open_port_warning("0.0.0.0", "k") is None and open_port_warning("127.0.0.1", None) is None


def test_no_pickle_eval_or_exec_anywhere_in_the_tree() -> None:
    banned = re.compile(r"\b(import pickle|from pickle|pickle\.loads?|cPickle|marshal\.loads?|eval\(|exec\(|"
                        r"shelve\.|dill\.|yaml\.load\()")
    hits = []
    for folder in ("protocol", "core", "worker", "frontend", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if banned.search(code) and "model.eval()" not in code and ".eval()" not in code:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


async def _try(address: str, keys: Path | None, timeout: float) -> list[int] | EngineError:
    client = EngineClient(address, "curve-test", curve_keys=str(keys) if keys else None)
    try:
        await client.connect(timeout=timeout)
    except EngineError as e:
        return e
    try:
        return [t async for out in client.generate("r", [1, 5, 9], SamplingParams(max_tokens=4, temperature=0))
                for t in out.new_token_ids]
    finally:
        await client.close()


@pytest.mark.slow
def test_curve_link_serves_only_authorized_frontends(tiny_llama: Path, tmp_path: Path) -> None:
    keys, rogue = tmp_path / "keys", tmp_path / "rogue"
    assert keygen_main([str(keys)]) == 0 and keygen_main([str(rogue)]) == 0
    for secret in keys.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    # The rogue knows the engine's public key, but its own key was never authorized.
    (rogue / "engine.key").write_bytes((keys / "engine.key").read_bytes())
    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.core", "--model", str(tiny_llama), "--listen", address,
                             "--curve-keys", str(keys), "--max-model-len", "256", "--num-kv-blocks", "32",
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--worker-threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            got = asyncio.run(_try(address, keys, timeout=2.0))
            if isinstance(got, list):
                break
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()
        assert len(got) == 4
        for keys_of_stranger in (None, rogue):  # no CURVE at all; CURVE with an unknown key
            refused = asyncio.run(_try(address, keys_of_stranger, timeout=1.5))
            assert isinstance(refused, EngineError) and refused.code == "connect_timeout"
        assert proc.poll() is None  # strangers did not disturb it
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
        log.close()


def test_no_log_call_prints_prompts_or_outputs() -> None:
    """Prompts and generated text stay out of the logs: no log call is handed request content."""
    call = re.compile(r"\b(log|logger)\.(debug|info|warning|error|exception|critical)\((.*)")
    content = re.compile(r"\b(prompt|prompts|prompt_token_ids|new_token_ids|messages|body|token_ids)\b|\.text\b")
    hits = []
    for folder in ("protocol", "core", "worker", "frontend"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = call.search(line)
                if m and content.search(m.group(3).split('"')[-1] if '"' in m.group(3) else m.group(3)):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
