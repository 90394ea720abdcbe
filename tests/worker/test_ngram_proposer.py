"""The vectorized n-gram proposer against a plain per-request reference of vLLM's rule."""

from __future__ import annotations

import numpy as np
from evenflow.worker.ngram_proposer import propose_ngram
from hypothesis import given, settings
from hypothesis import strategies as st


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix n-gram (min_n..max_n) seen earlier; earliest occurrence; up to k followers."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(0, length - n):  # the occurrence ends before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose_one(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    drafts, counts = propose_ngram(np.array([tokens]), np.array([len(tokens)]), np.array([k]), min_n, max_n)
    return drafts[0, : counts[0]].tolist()


def test_issue_example() -> None:
    assert propose_one([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_n_wins_then_earliest_occurrence() -> None:
    # "9 2 3" occurs once (followed by 7); "2 3" occurs twice, first followed by 5.
    tokens = [2, 3, 5, 9, 2, 3, 7, 9, 2, 3]
    assert propose_one(tokens, 2, 3, 2) == [7, 9]
    assert propose_one(tokens, 2, 2, 2) == [5, 9]


def test_no_match_below_min_and_caps() -> None:
    assert propose_one([1, 2, 3, 4, 2, 3], 3, 3, 4) == []  # only a 2-gram recurs
    assert propose_one([5, 5, 5, 5], 1, 3, 4) == [5]  # the only token after "5 5 5"
    assert propose_one([1, 2, 3, 4, 2, 3], 2, 3, 1) == [4]
    assert propose_one([1, 2, 3, 4, 2, 3], 2, 3, 0) == []
    assert propose_one([7], 1, 3, 4) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(0, 3),
    st.lists(st.integers(0, 6), min_size=6, max_size=6),
)
def test_batch_matches_reference(rows: list[list[int]], min_n: int, extra: int, ks: list[int]) -> None:
    max_n = min_n + extra
    width = max(map(len, rows)) + 3
    table = np.full((len(rows), width), -1, dtype=np.int64)  # junk past each row's length
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    lengths = np.array([len(r) for r in rows])
    drafts, counts = propose_ngram(table, lengths, np.array(ks[: len(rows)]), min_n, max_n)
    got = [drafts[i, : counts[i]].tolist() for i in range(len(rows))]
    assert got == [reference(row, min_n, max_n, k) for row, k in zip(rows, ks)]
