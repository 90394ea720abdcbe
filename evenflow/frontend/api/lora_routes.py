"""LoRA in the HTTP API: adapters in /v1/models, and vLLM's run-time load/unload routes.

``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist only with
``--allow-runtime-lora-updating`` (vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), which needs an API
key: they make the server read any folder on its host.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from evenflow.protocol import LoRALoad

from evenflow.frontend.api.context import ServingContext, decode_body, read_body
from evenflow.frontend.api.errors import APIError
from evenflow.frontend.api.openai import LoadLoRAAdapterRequest, ModelCard


def lora_model_cards(ctx: ServingContext) -> list[ModelCard]:
    """One card per adapter, its ``parent`` the base model (as vLLM lists them)."""
    return [ModelCard(a.name, ctx.created, ctx.max_model_len, root=a.path, parent=ctx.model_name)
            for a in ctx.lora.by_name.values()]


async def _call(ctx: ServingContext, method: str, args: LoRALoad) -> None:
    if not ctx.lora.enabled:
        raise APIError(400, "this server's engine-core serves no LoRA adapters (start it with --enable-lora)")
    try:
        result = await ctx.client.call_utility(method, lora=args)
    except Exception as e:  # a refusal: the engine's reason (bad folder, rank, targets, name in use)
        raise APIError(400, getattr(e, "message", "") or str(e)) from None
    ctx.lora.replace(result.lora_adapters)


async def load_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    body: LoadLoRAAdapterRequest = decode_body(await read_body(request, ctx.max_body_bytes), LoadLoRAAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "both 'lora_name' and 'lora_path' must be provided", "lora_name")
    if body.lora_name in ctx.served_names:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", "lora_name")
    await _call(ctx, "load_lora_adapter", LoRALoad(body.lora_name, body.lora_path, body.load_inplace))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    body: LoadLoRAAdapterRequest = decode_body(await read_body(request, ctx.max_body_bytes), LoadLoRAAdapterRequest)
    if ctx.lora.enabled:
        await ctx.lora.refresh(ctx.client)
    if ctx.lora.get(body.lora_name) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
    await _call(ctx, "unload_lora_adapter", LoRALoad(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


LORA_ROUTES = (("/v1/load_lora_adapter", load_lora_adapter), ("/v1/unload_lora_adapter", unload_lora_adapter))
