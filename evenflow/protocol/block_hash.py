"""Stable block hashes for prefix caching: the one definition, shared by the engine-core's KV cache
and the frontends' prefix-aware router (which predicts where a prompt's prefix is cached).

A block's hash covers its parent block's hash, its own token ids and optional extra keys (anything
else that changes the KV, e.g. an adapter or a cache salt), so equal hashes mean equal prefixes.
SHA-256 over a fixed byte encoding gives the same value in every process and run, unlike Python's
salted ``hash``; it is truncated to 16 bytes, which keeps dict keys small with no practical risk
of collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

BlockHash = bytes

# Parent of every first block: a fixed value, so the chain is the same everywhere.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"evenflow-kv-block-v1").digest()[:16]

_extra_encoder = msgspec.msgpack.Encoder()
_packers: dict[int, struct.Struct] = {}  # little-endian int64 packers by block size


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash of one full block: parent hash (None: first block), token ids, extra keys."""
    packer = _packers.get(len(token_ids))
    if packer is None:
        packer = _packers[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    data = (ROOT_BLOCK_HASH if parent_hash is None else parent_hash) + packer.pack(*token_ids)
    if extra_keys:
        data += _extra_encoder.encode(extra_keys)
    return hashlib.sha256(data).digest()[:16]


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_full_blocks: int,
    block_size: int,
    extra_keys: tuple[object, ...] | None = None,
) -> None:
    """Append hashes to ``block_hashes`` until it covers ``num_full_blocks`` blocks of ``token_ids``.

    Only blocks not hashed yet are hashed, so a growing request costs one hash per new full block.
    """
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        block_hashes.append(parent)


def adapter_extra_keys(adapter_identity: str | None) -> tuple[object, ...] | None:
    """The extra keys of every block of a request served by a LoRA adapter (None: the base model).

    The adapter's identity (a digest of its weights, evenflow/protocol/lora.py), never its name: the
    same prompt under two adapters, or under one name reloaded with new weights, has other KV.
    Engine-cores and prefix-routing frontends both call this, so their hashes agree.
    """
    return ("lora", adapter_identity) if adapter_identity else None
