"""The adapters an engine-core serves, by name: from ``--lora-modules`` and run-time loads.

Each name maps to an ``AdapterRef`` whose identity is the digest of the adapter's weights
(evenflow/protocol/lora.py), so a reload under the same name with new weights is a new adapter to the
prefix cache and to the workers; requests already running keep the reference they started with.
"""

from __future__ import annotations

from pathlib import Path

from evenflow.protocol.lora import AdapterRef, adapter_identity, parse_lora_module, read_adapter


class LoRARegistry:
    """name -> AdapterRef, checked against ``--max-lora-rank`` and the model's layer count."""

    def __init__(self, max_lora_rank: int, num_layers: int | None, lora_modules: list[str] = ()) -> None:
        self.max_lora_rank = max_lora_rank
        self.num_layers = num_layers
        self._by_name: dict[str, AdapterRef] = {}
        for entry in lora_modules:
            self.load(*parse_lora_module(entry))

    def load(self, name: str, path: str, inplace: bool = False) -> tuple[AdapterRef, AdapterRef | None]:
        """Check and add (or with ``inplace`` replace) an adapter; returns (new, replaced).

        ValueError with the reason for a bad folder, a rank over the limit, an unknown target, or a
        name in use without ``inplace``.
        """
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        old = self._by_name.get(name)
        if old is not None and not inplace:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded (pass load_inplace to replace it)")
        folder = Path(path).expanduser().resolve()
        config = read_adapter(folder, self.max_lora_rank, self.num_layers)
        ref = AdapterRef(name, adapter_identity(folder, config), str(folder), config.rank)
        self._by_name[name] = ref
        return ref, old

    def unload(self, name: str) -> AdapterRef:
        """Forget ``name``; KeyError when no adapter has it."""
        return self._by_name.pop(name)

    def get(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def refs(self) -> list[AdapterRef]:
        return list(self._by_name.values())
