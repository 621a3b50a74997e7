"""ROPE's per-element work, compiled (numba): the angles' cos and sin from the unscaled angles, and the rotation.

The arithmetic is :mod:`.rope`'s, operation for operation, in float32 without fast-math (so nothing is fused that
ggml does not fuse): frequency factors divide the angle, YaRN mixes the interpolated and extrapolated angles by its
ramp, ``cosf``/``sinf`` are the C library's, and each rotated value is ggml's ``x0*cos - x1*sin`` /
``x0*sin + x1*cos`` with the first product fused into the addition.  In numpy the same came to about thirty calls
on arrays of a few dozen values per node, 0.16 ms a node, four nodes a token in a two-layer model.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import cosf, sinf
from .compiled import fma32

F32 = np.float32

#: How a row's rotated pairs are laid out: (2i, 2i+1) (normal), (i, i + n_dims/2) (NeoX and the multi-section
#: modes), (i, i + n_dims) over twice n_dims values (vision).
PAIRS_ADJACENT, PAIRS_HALVES, PAIRS_VISION = 0, 1, 2


@njit(cache=True, inline="always")
def _cmax(a, b):  # type: ignore[no-untyped-def]
    return a if a > b else b  # C's MAX macro: a NaN b comes through


@njit(cache=True, inline="always")
def _cmin(a, b):  # type: ignore[no-untyped-def]
    return a if a < b else b


@njit(cache=True, nogil=True)
def cos_sin(theta: np.ndarray, ff: np.ndarray, has_ff: bool, freq_scale: float, ext_factor: float, low: float,
            high: float, mscale: float, sin_sign: float, cos: np.ndarray,
            sin: np.ndarray) -> None:  # pragma: no cover - compiled
    """cos and sin (n_pos, half) of every pair from its unscaled angle ``theta`` (n_pos, half), times ``mscale``
    (already YaRN's), the sine times ``sin_sign``."""
    n_pos, half = theta.shape
    one, zero = F32(1), F32(0)
    fs, ext, lo, ms, sign = F32(freq_scale), F32(ext_factor), F32(low), F32(mscale), F32(sin_sign)
    width = _cmax(F32(0.001), F32(F32(high) - lo))
    for p in range(n_pos):
        for i in range(half):
            t = theta[p, i]
            if has_ff:
                t = F32(t / ff[i])
            interp = F32(fs * t)
            if ext != zero:
                y = F32(F32(F32(i) - lo) / width)
                ramp = F32(F32(one - _cmin(one, _cmax(zero, y))) * ext)
                # interp * (1 - ramp) + t * ramp: upstream's compiler fuses the first product into the sum.
                t = fma32(interp, F32(one - ramp), F32(t * ramp))
            else:
                t = interp
            cos[p, i] = F32(cosf(t) * ms)
            sin[p, i] = F32(F32(sinf(t) * ms) * sign)


@njit(cache=True, nogil=True)
def rotate(x: np.ndarray, out: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, off: int,
           pairs: int) -> None:  # pragma: no cover - compiled
    """out = x (ne3, ne2, ne1, ne0) with the pairs of dims [off, off + n_dims) (vision: twice n_dims) rotated by
    row i2's cos and sin (ne2, pairs); every other value copied."""
    ne3, ne2, ne1, ne0 = x.shape
    n_pairs = n_dims if pairs == PAIRS_VISION else n_dims // 2
    step = 1 if pairs == PAIRS_ADJACENT else n_pairs
    for i3 in range(ne3):
        for i2 in range(ne2):
            c_row, s_row = cos[i2], sin[i2]
            for i1 in range(ne1):
                src, dst = x[i3, i2, i1], out[i3, i2, i1]
                for j in range(ne0):
                    dst[j] = src[j]
                for i in range(n_pairs):
                    a = off + (2 * i if pairs == PAIRS_ADJACENT else i)
                    b = a + step
                    x0, x1, c, s = src[a], src[b], c_row[i], s_row[i]
                    dst[a] = fma32(x0, c, -F32(x1 * s))
                    dst[b] = fma32(x0, s, F32(x1 * c))
