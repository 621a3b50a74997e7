"""Compiled loops (numba) for the small row ops of a decoding step, where numpy's dozen calls per node cost more than
the arithmetic: a two-layer model's token runs five RMS_NORMs of one row of 256 values, 9 us each in numpy against
about 1 us compiled.  Same rules as :mod:`.compiled`: float32 operations in float32 without fast-math, sums in the
order ggml adds.  Imported on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
F64 = np.float64


@njit(cache=True, nogil=True)
def rms_norm_rows(x: np.ndarray, eps: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) as ggml_compute_forward_rms_norm_f32: each square in float32 added to
    a double sum in order, the mean rounded to float32, ``1.0f/sqrtf(mean + eps)`` and a float32 scaling.  x and
    out: 2-D float32 (rows, n)."""
    rows, n = x.shape
    e = F32(eps)
    for r in range(rows):
        total = F64(0)
        for i in range(n):
            v = x[r, i]
            total += F64(v * v)
        mean = F32(total / max(n, 1))
        scale = F32(1) / np.sqrt(F32(mean + e))
        for i in range(n):
            out[r, i] = x[r, i] * scale
