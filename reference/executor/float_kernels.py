"""The float products' compiled loops: ``ggml_vec_dot_f32``/``_f16``/``_bf16`` one output at a time and llamafile's
tinyBLAS tiles, in the order upstream's AVX2 kernels add (:mod:`.fdot` says when each runs).  Same rules as
:mod:`.compiled`: every fused multiply-add rounded once, every other float32 operation in float32 without
fast-math; imported on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .compiled import F32, F64, _hadd_sum8, _hsum8
from .lanes8 import _dot_row, _fma_lanes, _tile_4x1, _tile_4x2, _tile_4x3, _tile_8x1, _tile_8x2, _tile_8x3
from .simd_sums import KIND_BF16, KIND_F32


@njit(cache=True, nogil=True)
def float_vec_dot(w: np.ndarray, x: np.ndarray, kind: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r, c] = ggml_vec_dot_f32/_f16/_bf16 (``kind``) of weight row c and row r of x, both float32 holding the
    operands' values: four accumulators of eight lanes per 32 elements, folded (0 + 2) + (1 + 3); the lanes summed
    by horizontal adds (F32/F16) or as hsum_float_8 (BF16); the elements past the last whole 32 one product at a
    time (F32: into the float32 sum; F16/BF16: each float32 product into a double).  Each output's loop is
    :func:`.lanes8._dot_row`, its accumulators in registers."""
    m, k = w.shape
    whole = k - k % 32
    lanes = np.empty(8, dtype=F32)
    for c in range(m):
        for r in range(x.shape[0]):
            _dot_row(w, c, x, r, whole, lanes)
            total = _lanes_total(kind, lanes)
            # The tail's row views only where there is a tail: views in this loop cost more than the row's dot.
            out[r, c] = total if whole == k else _dot_tail(w[c], x[r], whole, kind, total)


@njit(cache=True, inline="always")
def vec_dot_row(wr, xr, kind, lanes):  # type: ignore[no-untyped-def]
    # One output of float_vec_dot: wr and xr 1-D rows of contiguous float32 values, lanes float32 scratch (8).
    whole = wr.shape[0] - wr.shape[0] % 32
    _dot_row(wr, 0, xr, 0, whole, lanes)
    return _dot_tail(wr, xr, whole, kind, _lanes_total(kind, lanes))


@njit(cache=True, inline="always")
def _lanes_total(kind, lanes):  # type: ignore[no-untyped-def]
    # A float vector dot's eight folded lanes summed: horizontal adds (F32, F16) or hsum_float_8 (BF16).
    return _hsum8(lanes) if kind == KIND_BF16 else _hadd_sum8(lanes)


@njit(cache=True, inline="always")
def _dot_tail(wr, xr, whole, kind, total):  # type: ignore[no-untyped-def]
    # The elements past the last whole 32, one product at a time: F32 into the float32 sum, F16/BF16 each float32
    # product into a double.
    if kind == KIND_F32:
        for i in range(whole, wr.shape[0]):
            total = total + wr[i] * xr[i]
        return total
    wide = F64(total)
    for i in range(whole, wr.shape[0]):
        wide = wide + F64(wr[i] * xr[i])
    return F32(wide)


@njit(cache=True, nogil=True)
def tinyblas(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r, c] as llamafile's tinyBLAS computes it: one accumulator of eight lanes, a fused multiply-add per 8
    elements (the last partial 8 padded with zeros: 0 * 0 + lane), then hsum_float_8.  Eight (then four) weight rows
    by up to three activation rows at a time (:func:`.lanes8._tile_fma`: every output its own chain, in the same
    order; eight rows measured 15% faster than four on this 32-register machine)."""
    m, k = w.shape
    n = x.shape[0]
    whole = k - k % 8
    acc = np.empty(192, dtype=F32)
    tw = np.zeros(8, dtype=F32)
    tx = np.zeros(8, dtype=F32)
    c = 0
    while c + 8 <= m:
        _tinyblas_block(w, c, 8, x, whole, acc, tw, tx, out)
        c += 8
    if c + 4 <= m:
        _tinyblas_block(w, c, 4, x, whole, acc, tw, tx, out)
        c += 4
    for last in range(c, m):
        for r in range(n):
            acc[:8] = F32(0)
            for i in range(0, whole, 8):
                _fma_lanes(w[last], x[r], i, acc, 0)
            _tinyblas_end(w[last], x[r], whole, acc, 0, tw, tx)
            out[r, last] = _hsum8(acc[:8])


@njit(cache=True, inline="always")
def _tinyblas_block(w, c, rm, x, whole, acc, tw, tx, out):  # type: ignore[no-untyped-def]
    # Weight rows c .. c + rm (rm 8 or 4) against every activation row, three (or two) at a time.
    n = x.shape[0]
    r = 0
    while r < n:
        rn = 2 if n - r == 4 else min(3, n - r)  # 3 + 1 rows as 2 + 2: a lone row loads a weight per product
        acc[:] = F32(0)
        if rm == 8:
            if rn == 3:
                _tile_8x3(w, c, x, r, whole, acc)
            elif rn == 2:
                _tile_8x2(w, c, x, r, whole, acc)
            else:
                _tile_8x1(w, c, x, r, whole, acc)
        elif rn == 3:
            _tile_4x3(w, c, x, r, whole, acc)
        elif rn == 2:
            _tile_4x2(w, c, x, r, whole, acc)
        else:
            _tile_4x1(w, c, x, r, whole, acc)
        for a in range(rm):
            for b in range(rn):
                t = 8 * (a * rn + b)
                _tinyblas_end(w[c + a], x[r + b], whole, acc, t, tw, tx)
                out[r + b, c + a] = _hsum8(acc[t:t + 8])
        r += rn


@njit(cache=True, inline="always")
def _tinyblas_end(wr, xr, whole, acc, at, tw, tx):  # type: ignore[no-untyped-def]
    # The last partial 8 of a row, padded with zeros, fused into acc[at:at + 8].
    k = wr.shape[0]
    if whole < k:
        for j in range(8):
            tw[j] = wr[whole + j] if whole + j < k else F32(0)
            tx[j] = xr[whole + j] if whole + j < k else F32(0)
        _fma_lanes(tw, tx, 0, acc, at)
