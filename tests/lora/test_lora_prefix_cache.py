"""The prefix cache and the prefix router key blocks by the adapter's identity (a digest of its
weights): two adapters never share a prompt's blocks, one adapter does, a reload with new weights
under the same name hits nothing stale, and the frontend's router hashes exactly as the engine."""

from __future__ import annotations

import shutil
from pathlib import Path

from evenflow.core.kv.manager import KVCacheManager
from evenflow.core.lora_registry import LoRARegistry
from evenflow.protocol import AdapterRef
from evenflow.core.kv.events import KVEventLog
from evenflow.frontend.clients.data_parallel import route_hashes
from evenflow.frontend.clients.router import Router, RoutingConfig
from tests.core.test_kv_cache_manager import admit, make_request
from tests.lora_adapters import make_random_adapter

PROMPT = list(range(13))  # three full blocks of 4, the last token always recomputed


def lora_request(request_id: str, adapter: AdapterRef | None):  # noqa: ANN201
    request = make_request(request_id, PROMPT)
    request.set_lora(adapter)
    return request


def test_adapters_never_share_blocks_and_one_adapter_does(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    registry = LoRARegistry(16, 2, [f"a={lora_adapters['all']}", f"b={lora_adapters['attn']}"])
    a, b = registry.get("a"), registry.get("b")
    kv = KVCacheManager(num_blocks=32, block_size=4)
    admit(kv, lora_request("first-a", a))
    assert kv.get_computed_blocks(lora_request("b", b)).num_tokens == 0
    assert kv.get_computed_blocks(lora_request("base", None)).num_tokens == 0
    assert kv.get_computed_blocks(lora_request("again-a", a)).num_tokens == 12
    admit(kv, lora_request("first-base", None))
    assert kv.get_computed_blocks(lora_request("base-again", None)).num_tokens == 12
    assert kv.get_computed_blocks(lora_request("b-again", b)).num_tokens == 0


def test_reload_with_new_weights_under_the_same_name_gets_no_stale_block(
        tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "adapter"
    shutil.copytree(lora_adapters["all"], folder)
    registry = LoRARegistry(16, 2, [f"sql={folder}"])
    old = registry.get("sql")
    kv = KVCacheManager(num_blocks=32, block_size=4)
    admit(kv, lora_request("old", old))
    # Retrained in place: same name, same path, new weights.
    shutil.rmtree(folder)
    make_random_adapter(tiny_llama, folder, seed=99)
    new, replaced = registry.load("sql", str(folder), inplace=True)
    assert replaced == old and new.name == old.name and new.path == old.path and new.identity != old.identity
    assert kv.get_computed_blocks(lora_request("new", new)).num_tokens == 0
    assert kv.get_computed_blocks(lora_request("old-again", old)).num_tokens == 12


def test_router_hashes_and_routes_a_prompt_as_the_engine_caches_it(lora_adapters: dict[str, Path]) -> None:
    registry = LoRARegistry(16, 2, [f"a={lora_adapters['all']}", f"b={lora_adapters['attn']}"])
    a, b = registry.get("a"), registry.get("b")
    kv = KVCacheManager(num_blocks=32, block_size=4)
    kv.pool.events = events = KVEventLog()
    for name, ref in (("base", None), ("a", a)):
        request = lora_request(name, ref)
        admit(kv, request)
        assert route_hashes(PROMPT, 4, ref) == request.block_hashes[:3]
    # Engine 1 cached the prompt under adapter a (its KV events reach the router).
    router = Router.for_engines(RoutingConfig("prefix"), [32, 32])
    router.on_kv_events(1, events.drain(True))  # type: ignore[arg-type]
    assert router.choose(route_hashes(PROMPT, 4, a), [0, 1]).engine == 1
    assert router.choose(route_hashes(PROMPT, 4, a), [0, 1]).matched_blocks == 3
    assert router.choose(route_hashes(PROMPT, 4, b), [0, 1]).matched_blocks == 0
