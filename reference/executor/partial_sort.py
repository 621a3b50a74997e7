"""TOP_K's selection as ggml's CPU backend makes it: a heap-based partial sort, ties in the order it leaves them.

ggml's CPU TOP_K fills a row of indices 0..n-1 and partially sorts them with the C++ standard library's
``partial_sort`` under "greater value first".  Where values tie (or compare false both ways, as NaN does), which index
comes first is not "smallest index first" but whatever the heap operations leave, and it is that order upstream's
server returns.  This module performs the same sequence of comparisons and moves as the GNU implementation
(libstdc++, the library of every upstream build the kit installs): a heap built over the first k indices, every later
index that compares greater than the heap's top replacing it, then the heap sorted in place.  For distinct values
the result is simply the k largest, largest first.

Compiled with numba (imported by TOP_K on first use): a row of a few hundred thousand elements is a few
milliseconds, where an interpreted heap would take seconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _sift(idx, value, hole, length, x):  # type: ignore[no-untyped-def]
    # Move the hole at `hole` down to a leaf along the greater child, then bubble `value` up from there: the
    # standard library's adjust-heap with its push-heap, on indices ordered by x, "greater" being the heap's less.
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if x[idx[child]] > x[idx[child - 1]]:
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and x[idx[parent]] > x[value]:
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


@njit(cache=True, nogil=True)
def top_k_rows(x: np.ndarray, k: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r] = the first k of row r's indices after the partial sort (x: (rows, n) float32, out: (rows, k) int32)."""
    n = x.shape[1]
    idx = np.empty(n, dtype=np.int32)
    for r in range(x.shape[0]):
        row = x[r]
        for j in range(n):
            idx[j] = j
        if k >= 2:
            parent = (k - 2) // 2
            while True:
                _sift(idx, idx[parent], parent, k, row)
                if parent == 0:
                    break
                parent -= 1
        for i in range(k, n):
            if row[idx[i]] > row[idx[0]]:
                value = idx[i]
                idx[i] = idx[0]
                _sift(idx, value, 0, k, row)
        last = k
        while last > 1:
            last -= 1
            value = idx[last]
            idx[last] = idx[0]
            _sift(idx, value, 0, last, row)
        for j in range(k):
            out[r, j] = idx[j]
