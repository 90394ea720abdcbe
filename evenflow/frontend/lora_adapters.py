"""The LoRA adapters a frontend can name: the engine's list (Ready, then every LoRA utility call).

A request chooses one by its ``model`` field. With several frontends, one that misses a name asks
the engine again before answering 404, since another frontend may have loaded it at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evenflow.protocol import AdapterRef, Ready


@dataclass
class LoRAAdapters:
    """name -> AdapterRef; ``enabled`` False when the engine serves no adapters at all."""

    enabled: bool = False
    by_name: dict[str, AdapterRef] = field(default_factory=dict)

    @classmethod
    def from_ready(cls, ready: Ready) -> "LoRAAdapters":
        adapters = getattr(ready, "lora_adapters", None)
        return cls(adapters is not None, {a.name: a for a in adapters or ()})

    def get(self, name: str) -> AdapterRef | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)

    def replace(self, adapters: list[AdapterRef]) -> None:
        self.by_name = {a.name: a for a in adapters}

    async def refresh(self, client: Any) -> None:
        """Ask the engine for its current list (nothing when LoRA is off)."""
        if self.enabled:
            self.replace((await client.call_utility("list_lora_adapters")).lora_adapters)
