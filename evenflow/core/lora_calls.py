"""The engine-core's LoRA entry points: the registry from the flags, a request's adapter, the utility calls.

``list_lora_adapters``, ``load_lora_adapter`` and ``unload_lora_adapter`` (with ``UtilityCall.lora``)
answer with every adapter served after the call (``UtilityResult.lora_adapters``); a refusal is
``ok=false`` with the reason. Who may call them is the frontend's business (its HTTP routes sit
behind ``--allow-runtime-lora-updating`` and the API key).
"""

from __future__ import annotations

from evenflow.protocol import ERR_UNKNOWN_LORA_ADAPTER, Error, UtilityCall, UtilityResult
from evenflow.protocol.hf_config import read_hf_config
from evenflow.protocol.lora import AdapterRef

from evenflow.core.engine_config import EngineConfig
from evenflow.core.lora_registry import LoRARegistry
from evenflow.core.sched.scheduler import Scheduler

LORA_METHODS = ("list_lora_adapters", "load_lora_adapter", "unload_lora_adapter")


def lora_registry_for(cfg: EngineConfig) -> LoRARegistry | None:
    """The registry with ``--lora-modules`` loaded (None without ``--enable-lora``)."""
    if not cfg.enable_lora:
        return None
    num_layers = read_hf_config(cfg.model).text.get("num_hidden_layers")
    return LoRARegistry(cfg.max_lora_rank, num_layers if isinstance(num_layers, int) else None, cfg.lora_modules)


def lora_of_request(registry: LoRARegistry | None, name: str) -> AdapterRef | Error:
    """The adapter a request names, or the ``unknown_lora_adapter`` Error (without its request id)."""
    if registry is None:
        return Error(ERR_UNKNOWN_LORA_ADAPTER, f"lora_name {name!r}: this engine-core serves no LoRA adapters "
                                               f"(start it with --enable-lora)")
    ref = registry.get(name)
    if ref is None:
        known = ", ".join(r.name for r in registry.refs()) or "none"
        return Error(ERR_UNKNOWN_LORA_ADAPTER, f"unknown LoRA adapter {name!r} (served: {known})")
    return ref


def lora_utility(call: UtilityCall, registry: LoRARegistry | None, scheduler: Scheduler) -> UtilityResult:
    if registry is None:
        return UtilityResult(call.call_id, False, None, "LoRA is off on this engine-core (--enable-lora)")
    args = call.lora
    try:
        if call.method == "load_lora_adapter":
            if args is None or not args.lora_path:
                raise ValueError("load_lora_adapter needs lora_name and lora_path")
            _, replaced = registry.load(args.lora_name, args.lora_path, args.load_inplace)
            if replaced is not None and scheduler.lora_slots is not None:
                scheduler.lora_slots.unload(replaced.identity, _in_use(scheduler, replaced))
        elif call.method == "unload_lora_adapter":
            if args is None:
                raise ValueError("unload_lora_adapter needs lora_name")
            try:
                removed = registry.unload(args.lora_name)
            except KeyError:
                raise ValueError(f"unknown LoRA adapter {args.lora_name!r}") from None
            if scheduler.lora_slots is not None:
                scheduler.lora_slots.unload(removed.identity, _in_use(scheduler, removed))
    except ValueError as e:
        return UtilityResult(call.call_id, False, None, str(e), registry.refs())
    return UtilityResult(call.call_id, True, True, "", registry.refs())


def _in_use(scheduler: Scheduler, ref: AdapterRef) -> bool:
    return any(r.lora is not None and r.lora.identity == ref.identity for r in scheduler.requests.values())
