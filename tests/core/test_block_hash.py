from __future__ import annotations

import subprocess
import sys

from evenflow.protocol.block_hash import extend_block_hashes, hash_block_tokens


def test_hash_is_stable_across_processes() -> None:
    # Python's hash() is salted per process; ours must not be.
    code = "from evenflow.protocol.block_hash import hash_block_tokens as h; print(h(None, [1, 2, 3]).hex())"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert outputs == {hash_block_tokens(None, [1, 2, 3]).hex()}


def test_hash_chains_the_parent_and_covers_tokens_and_extra_keys() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second != hash_block_tokens(None, [5, 6, 7, 8])  # same tokens, other prefix
    assert second != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("adapter-a",)) != first
    assert hash_block_tokens(None, [1, 2, 3, 4], ("adapter-a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("b",))
    assert len(first) == 16


def test_extend_hashes_only_new_full_blocks() -> None:
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 2, 4)
    assert hashes == [hash_block_tokens(None, tokens[:4]), hash_block_tokens(hashes[0], tokens[4:8])]
    before = list(hashes)
    extend_block_hashes(hashes, tokens, 2, 4)
    assert hashes == before
    extend_block_hashes(hashes, tokens + [10, 11], 3, 4)
    assert hashes[:2] == before and hashes[2] == hash_block_tokens(before[1], [8, 9, 10, 11])
