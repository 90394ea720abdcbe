"""The n-gram (prompt lookup) proposer, vectorized over the batch.

vLLM's semantics: for each request, find the longest suffix n-gram of its tokens (prompt +
output), ``n`` in ``[min_n, max_n]``, that also occurs earlier in those tokens; propose up to
``k`` tokens that followed the earliest such occurrence. Every request is handled at once with
numpy over a ``[requests, positions]`` table: one pass per ``n``, no Python loop per token.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(
    tokens: np.ndarray, lengths: np.ndarray, max_drafts: np.ndarray, min_n: int, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each row of ``tokens [R, L]`` (row r holds ``lengths[r]`` valid tokens).

    ``max_drafts[r]`` caps row r's proposal (K, max_model_len and max_tokens already applied by
    the caller; <= 0 proposes nothing). Returns ``(drafts [R, K] int64, num_drafts [R])`` where
    ``K = max(max_drafts)``; entries past ``num_drafts[r]`` are 0.
    """
    num_rows = tokens.shape[0]
    k = int(max_drafts.max(initial=0))
    drafts = np.zeros((num_rows, max(k, 0)), dtype=np.int64)
    num_drafts = np.zeros(num_rows, dtype=np.int64)
    if num_rows == 0 or k <= 0:
        return drafts, num_drafts
    width = int(lengths.max())
    table = tokens[:, :width]
    rows = np.arange(num_rows)
    # suffix[r, i]: the (i+1)-th token from the end of row r.
    suffix = table[rows[:, None], np.maximum(lengths[:, None] - 1 - np.arange(max_n), 0)]
    ends = np.arange(width)
    # match[r, j]: the n tokens ending at j equal row r's last n tokens. j <= length - 2: the
    # occurrence is earlier than the suffix itself and at least one token follows it.
    match = (table == suffix[:, :1]) & (ends[None, :] <= (lengths - 2)[:, None])
    best_end = np.full(num_rows, -1, dtype=np.int64)
    for n in range(1, max_n + 1):
        if n > 1:
            match[:, : n - 1] = False
            match[:, n - 1 :] &= table[:, : width - n + 1] == suffix[:, n - 1 : n]
        found = match.any(axis=1)
        if not found.any():
            break
        if n >= min_n:  # a longer n wins; argmax is the earliest occurrence
            best_end = np.where(found, match.argmax(axis=1), best_end)
    start = best_end + 1
    available = np.where(best_end >= 0, lengths - start, 0)
    num_drafts = np.clip(np.minimum(available, max_drafts), 0, None)
    cols = np.minimum(start[:, None] + np.arange(k), width - 1)
    drafts = np.where(np.arange(k) < num_drafts[:, None], table[rows[:, None], cols], 0)
    return drafts, num_drafts
