"""The block-hash rule lives in protocol/ (frontends compute the same hashes to route by prefix)."""

from evenflow.protocol.block_hash import ROOT_BLOCK_HASH, BlockHash, extend_block_hashes, hash_block_tokens

__all__ = ["ROOT_BLOCK_HASH", "BlockHash", "extend_block_hashes", "hash_block_tokens"]
