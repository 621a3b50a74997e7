"""FLASH_ATTN_EXT's one-query recurrence with an F16 V, compiled (numba): ggml's loop, one query row at a time.

For each KV position in order: a position whose score is -inf is skipped; on a new maximum the F16 accumulator is
rescaled by ``expf(old - new)`` (each value rounded back to F16) and the position's weight is 1, otherwise its weight
is ``expf(s - max)``; the weighted V row is added with one fused multiply-add per value (rounded once to float32,
then to F16); the denominator follows ``S = S * ms + vs``, fused too.  ``expf`` is the C library's.  Those are the
roundings upstream's build makes, measured against its FLASH_ATTN_EXT results; tests/executor/test_attention_online.py
checks this loop against the same recurrence written out in Python.  numpy could only take one step per KV position
over every row (a dozen calls each, 1.4 ms of a tiny model's 5 ms token); compiled, a row is a few microseconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import expf, to_half
from .compiled import fma32

F32 = np.float32


@njit(cache=True, nogil=True)
def online_rows(scores: np.ndarray, v: np.ndarray, v_of: np.ndarray, sinks: np.ndarray, has_sinks: bool,
                out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r] = the attention of row r: scores (R, n_kv) float32 (scaled, masked), v (G, n_kv, dv) float32 holding
    F16 values, v_of (R,) the V matrix of each row, sinks (R,) each row's sink (read when ``has_sinks``)."""
    n_rows, n_kv = scores.shape
    dv = v.shape[2]
    acc = np.empty(dv, dtype=F32)
    neg_inf = F32(-np.inf)
    one, zero = F32(1), F32(0)
    for r in range(n_rows):
        acc[:] = zero
        m = neg_inf
        total = zero
        vr = v[v_of[r]]
        for ic in range(n_kv):
            s = scores[r, ic]
            if s == neg_inf:
                continue
            ms, vs = one, one
            if s > m:
                ms = expf(F32(m - s))
                m = s
                for j in range(dv):
                    acc[j] = to_half(F32(acc[j] * ms))
            else:
                vs = expf(F32(s - m))
            row = vr[ic]
            for j in range(dv):
                acc[j] = to_half(fma32(row[j], vs, acc[j]))
            total = fma32(total, ms, vs)
        scale = one
        if has_sinks:
            sink = sinks[r]
            ms, vs = one, one
            if sink > m:
                ms = expf(F32(m - sink))
            else:
                vs = expf(F32(sink - m))
            scale = ms
            total = fma32(total, ms, vs)
        inv = one / total if total != zero else zero
        for j in range(dv):
            out[r, j] = F32(acc[j] * scale) * inv
