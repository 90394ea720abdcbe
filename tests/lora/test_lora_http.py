"""LoRA through the HTTP API of a live engine-core and two frontends: adapters in /v1/models, chosen
by the model field (outputs equal transformers + peft), clear 400/404s, and the run-time load/unload
routes, which exist only on a frontend started with --allow-runtime-lora-updating, behind its API key."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.frontend.live import start, stop, wait_for
from tests.ports import free_port
from tests.lora_adapters import make_random_adapter, peft_greedy

pytestmark = pytest.mark.slow

KEY = "sekret"
PROMPT = [5, 17, 33, 4, 99, 120, 7, 8, 9, 10, 11, 12]


class Servers:
    def __init__(self, updating: str, plain: str) -> None:
        self.updating, self.plain = updating, plain  # frontend URLs: with and without run-time updating

    def complete(self, url: str, model: str, max_tokens: int = 6) -> httpx.Response:
        return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})

    def tokens(self, url: str, model: str) -> list[int]:
        response = self.complete(url, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model  # the adapter's name when one served it, as vLLM
        return response.json()["choices"][0]["token_ids"]

    def post(self, path: str, body: dict, key: str | None = KEY, url: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post((url or self.updating) + path, json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-lora")
    return {
        "a": make_random_adapter(demo_model_dir, root / "a", seed=11),
        "b": make_random_adapter(demo_model_dir, root / "b", seed=12, rank=8, targets=("q_proj", "v_proj")),
        "b2": make_random_adapter(demo_model_dir, root / "b2", seed=13, targets=("o_proj", "down_proj")),
        "rank16": make_random_adapter(demo_model_dir, root / "rank16", seed=14, rank=16, targets=("q_proj",)),
    }


@pytest.fixture(scope="module")
def servers(demo_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("lora-live")
    engine_addr = f"ipc://{tmp}/engine.sock"
    ports = [free_port(), free_port()]
    logs = [tmp / "engine.log", tmp / "frontend-updating.log", tmp / "frontend-plain.log"]
    procs = [start(["-m", "evenflow.core.cli", "--model", str(demo_model_dir), "--listen", engine_addr,
                    "--served-model-name", "demo", "--max-model-len", "256", "--num-kv-blocks", "64",
                    "--max-num-batched-tokens", "64", "--dtype", "float32", "--enable-lora", "--max-loras", "2",
                    "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}"], logs[0])]
    for port, log, extra in zip(ports, logs[1:], (["--allow-runtime-lora-updating"], [])):
        procs.append(start(["-m", "evenflow.frontend.cli", "--engine", engine_addr, "--port", str(port),
                            "--api-key", KEY, *extra], log))
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_for(lambda url=url: httpx.get(url + "/health", timeout=5).status_code == 200, 120, procs, logs)
        yield Servers(*urls)
    finally:
        stop(procs[1:])
        stop(procs[:1])


def test_models_list_adapters_with_their_parent(servers: Servers, adapters: dict[str, Path]) -> None:
    cards = httpx.get(servers.plain + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    by_id = {c["id"]: c for c in cards}
    assert by_id["a"]["parent"] == "demo" and by_id["a"]["root"] == str(adapters["a"].resolve())
    assert by_id["demo"]["parent"] is None


def test_the_model_field_chooses_the_adapter(servers: Servers, demo_model_dir: Path, adapters: dict[str, Path]) -> None:
    assert servers.tokens(servers.plain, "a") == peft_greedy(demo_model_dir, adapters["a"], PROMPT, 6)
    assert servers.tokens(servers.plain, "demo") == peft_greedy(demo_model_dir, None, PROMPT, 6)
    response = servers.complete(servers.plain, "nope")
    assert response.status_code == 404 and "The model `nope` does not exist" in response.text
    assert "a" in response.json()["error"]["message"]  # the served names include the adapters


def test_runtime_routes_exist_only_when_asked_and_need_the_key(servers: Servers, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "x", "lora_path": str(adapters["b"])}
    assert servers.post("/v1/load_lora_adapter", body, url=servers.plain).status_code == 404
    assert servers.post("/v1/load_lora_adapter", body, key=None).status_code == 401
    assert servers.post("/v1/load_lora_adapter", body, key="wrong").status_code == 401


@pytest.mark.parametrize("path, reason", [
    ("/no/such/folder", "is not a folder"),
    ("rank16", "above --max-lora-rank 8"),
])
def test_bad_adapters_are_400_with_the_reason(servers: Servers, adapters: dict[str, Path], path: str,
                                              reason: str) -> None:
    response = servers.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters.get(path, path))})
    assert response.status_code == 400 and reason in response.json()["error"]["message"]


def test_load_use_reload_unload(servers: Servers, demo_model_dir: Path, adapters: dict[str, Path]) -> None:
    response = servers.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert response.status_code == 200, response.text
    dup = servers.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert dup.status_code == 400 and "already loaded" in dup.text
    # The other frontend did not load it, yet serves it (it asks the engine on a miss).
    assert servers.tokens(servers.plain, "b") == peft_greedy(demo_model_dir, adapters["b"], PROMPT, 6)
    response = servers.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b2"]),
                                                      "load_inplace": True})
    assert response.status_code == 200, response.text
    assert servers.tokens(servers.updating, "b") == peft_greedy(demo_model_dir, adapters["b2"], PROMPT, 6)
    assert servers.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert servers.complete(servers.plain, "b").status_code == 404
    assert servers.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
