"""The activations' 8-bit codes of the 8-bit-activation products, compiled (numba): ggml's AVX2
``quantize_row_q8_0``/``_q8_1`` (see :func:`.quant._q8_scale`) written straight into the kernels' lane order.

In numpy the same took a dozen calls per product (about 15 microseconds even for one row of 256), which a small
model's fourteen small products a token paid fourteen times.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import to_half

F32 = np.float32


@njit(cache=True, nogil=True)
def activation_lanes(x: np.ndarray, summed: bool, codes: np.ndarray, d16: np.ndarray,
                     sums: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Rows x (n, k) float32 as Q8_0/Q8_1 blocks: codes int8 (n, k) in lane order (element 4i + t of a block at
    position 8t + i), d16 float32 (n, k / 32) the fp16 scales, sums (``summed``) the fp16 block sums as float32.
    Returns False, leaving the outputs unspecified, when a block holds a value that is not finite (the caller
    quantises those rows as numpy does)."""
    n, k = x.shape
    nb = k // 32
    zero = F32(0)
    for r in range(n):
        row, out = x[r], codes[r]
        for b in range(nb):
            o = b * 32
            amax = zero
            for j in range(32):
                v = abs(row[o + j])
                if not v <= np.float32(3.4028235e38):  # NaN or infinite
                    return False
                amax = v if v > amax else amax
            d = F32(amax / F32(127))
            inv = F32(F32(127) / amax) if amax != zero else zero
            total = 0
            for e in range(32):
                q = np.int32(np.rint(F32(row[o + e] * inv)))
                out[o + (e % 4) * 8 + e // 4] = np.int8(q)
                total += q
            d16[r, b] = to_half(d)
            sums[r, b] = to_half(F32(F32(total) * d)) if summed else zero
    return True
