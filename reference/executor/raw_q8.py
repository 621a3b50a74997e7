"""The 8-bit-activation products read straight from the weights' blocks, compiled (numba): for weights too large
for the conversion cache, which would otherwise be packed anew (:func:`.compiled.decode_q8_rows`) every graph.

Each weight row is decoded once, in the elements' own order, into a row of codes that stays in the processor's
cache; the products and their accumulation are :mod:`.compiled`'s, so the results are the packed form's bit for bit.
Imported by :func:`.q8dot.raw_products` on first use.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .compiled import F32, _row_total


@njit(cache=True, nogil=True)
def raw_q8_products(raw: np.ndarray, size: int, scale_at: int, e8m0: bool, min_at: int, qh_at: int, qs_at: int,
                    nibbles: bool, table: np.ndarray, halves: np.ndarray, xq: np.ndarray, xd: np.ndarray,
                    xs: np.ndarray, two: bool, summed: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """:func:`.compiled.q8_products` read straight from the weights' blocks (raw uint8 (m, nb * size), described
    as for :func:`.compiled.decode_q8_rows`), with xq in the elements' own order: each weight row is decoded once
    into a row of codes that stays in the cache, for weights too large to keep in packed form.  ``halves``: the
    float32 value of every fp16 bit pattern (65,536; a lookup per block instead of a conversion)."""
    # One copy of the loop per flag pair, each flag a constant in it (as in :func:`.compiled.q8_products`).
    if summed:
        if two:
            _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, halves, xq, xd, xs, True, True,
                      out)
        else:
            _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, halves, xq, xd, xs, False,
                      True, out)
    elif two:
        _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, halves, xq, xd, xs, True, False,
                  out)
    else:
        _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, halves, xq, xd, xs, False, False,
                  out)


@njit(cache=True, inline="always")
def _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, halves, xq, xd, xs, two, summed,
              out):  # type: ignore[no-untyped-def]
    m = raw.shape[0]
    n, k = xq.shape
    nb = k // 32
    # Q4_0, Q4_1, Q5_0, Q5_1's codes are the value plus a constant: no lookup, so that the loop vectorises.
    first = np.int32(table[0])
    linear = True
    for v in range(32):
        linear = linear and np.int32(table[v]) == first + v
    codes = np.empty(k, dtype=np.int8)
    p = np.empty(k, dtype=np.int32)
    acc = np.empty(16, dtype=F32)
    wd = np.empty(nb, dtype=F32)
    wm = np.zeros(nb, dtype=F32)
    for c in range(m):
        row = raw[c]
        for b in range(nb):
            o = b * size
            if e8m0:
                wd[b] = F32(math.ldexp(1.0, np.int32(row[o + scale_at]) - 128))
            else:
                wd[b] = halves[np.int32(row[o + scale_at]) | (np.int32(row[o + scale_at + 1]) << 8)]
            if min_at >= 0:
                wm[b] = halves[np.int32(row[o + min_at]) | (np.int32(row[o + min_at + 1]) << 8)]
            q = o + qs_at
            base = b * 32
            if nibbles:  # element j < 16: the low nibble of byte j; j + 16: its high nibble (the high bit from qh)
                qh = np.uint32(0)
                if qh_at >= 0:
                    qh = (np.uint32(row[o + qh_at]) | (np.uint32(row[o + qh_at + 1]) << 8)
                          | (np.uint32(row[o + qh_at + 2]) << 16) | (np.uint32(row[o + qh_at + 3]) << 24))
                if linear and qh_at < 0:  # Q4_0, Q4_1: the nibble plus the table's first code
                    for j in range(16):
                        v = np.int32(row[q + j])
                        codes[base + j] = np.int8((v & 15) + first)
                        codes[base + 16 + j] = np.int8((v >> 4) + first)
                    continue
                for j in range(16):
                    v = np.int32(row[q + j])
                    lo = (v & 15) | (np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4)
                    hi = (v >> 4) | (np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4)
                    if linear:
                        codes[base + j] = np.int8(lo + first)
                        codes[base + 16 + j] = np.int8(hi + first)
                    else:
                        codes[base + j] = table[lo]
                        codes[base + 16 + j] = table[hi]
            else:
                for j in range(32):
                    codes[base + j] = np.int8(row[q + j])
        for r in range(n):
            x = xq[r]
            for j in range(k):
                p[j] = np.int32(codes[j]) * np.int32(x[j])
            out[r, c] = _row_total(p, wd, xd[r], wm, xs[r], two, summed, True, acc)
