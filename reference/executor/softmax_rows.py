"""SOFT_MAX's rows as ggml's CPU backend computes them, compiled (numba): each row scaled, the mask added (times the
head's ALiBi slope, the product fused into the sum by upstream's compiler: measured on a row of 256 where the
fused and unfused forms differ in 26 values, upstream 7.0.0's result is the fused form's), its maximum (with the
sink's), then ``ggml_vec_soft_max_f32``: ggml's vector exp eight values at a time (the row's last ``n % 8`` with
the C library's expf), each group's float sum added to a double; the sink's expf added to that sum; the row
multiplied by the float of ``1.0 / sum``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import expf
from .compiled import _hsum8, fma32
from .vsilu import v_expf

F32 = np.float32


@njit(cache=True, inline="always")
def vec_max(x):  # type: ignore[no-untyped-def]
    """ggml_vec_max_f32: C's MAX(max, x[i]) over the row, from -inf (a NaN value comes through)."""
    mx = F32(-np.inf)
    for i in range(x.shape[0]):
        mx = mx if mx > x[i] else x[i]
    return mx


@njit(cache=True, inline="always")
def vec_soft_max(x, y, mx):  # type: ignore[no-untyped-def]
    """ggml_vec_soft_max_f32: y = exp(x - mx), ggml's vector exp for whole groups of eight (each group's float sum,
    in hsum order, added to a double) and the C library's expf for the rest; returns the double sum.  y may be x."""
    n = x.shape[0]
    whole = n - n % 8
    total = np.float64(0)
    for g in range(0, whole, 8):
        for i in range(8):
            y[g + i] = v_expf(F32(x[g + i] - mx))
        total += np.float64(_hsum8(y[g : g + 8]))
    for i in range(whole, n):
        y[i] = expf(F32(x[i] - mx))
        total += np.float64(y[i])
    return total


@njit(cache=True, nogil=True)
def soft_max_rows(x: np.ndarray, scale: float, mask: np.ndarray, has_mask: bool, slopes: np.ndarray,
                  sinks: np.ndarray, has_sinks: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out (n3, n2, n1, n0) = SOFT_MAX of x (same shape, float32); mask float32 (m3, m2, n1 or more, n0 or more)
    repeating over dims 3 and 2 by modulo; slopes, sinks float32 (n2,)."""
    n3, n2, n1, n0 = x.shape
    m3, m2 = mask.shape[0], mask.shape[1]
    sc = F32(scale)
    wp = np.empty(n0, dtype=F32)
    for i3 in range(n3):
        for i2 in range(n2):
            slope = slopes[i2]
            for i1 in range(n1):
                row, dst = x[i3, i2, i1], out[i3, i2, i1]
                for i in range(n0):
                    wp[i] = F32(row[i] * sc)
                if has_mask:
                    mrow = mask[i3 % m3, i2 % m2, i1]
                    for i in range(n0):
                        wp[i] = fma32(slope, mrow[i], wp[i])
                mx = vec_max(wp)
                if has_sinks:
                    mx = mx if mx > sinks[i2] else sinks[i2]
                total = vec_soft_max(wp, dst, mx)
                if has_sinks:
                    total += np.float64(expf(F32(sinks[i2] - mx)))
                inv = F32(1.0 / total)
                for i in range(n0):
                    dst[i] = F32(dst[i] * inv)
