"""ggml's vector SiLU (``ggml_v_expf``, ``ggml_v_silu``) and the C library's for a row's tail, compiled (numba).

The same steps as :mod:`.simd_math`, one element at a time (each lane of ggml's vector is independent): a row's
elements in whole groups of eight through the polynomial exp, the last ``n % 8`` through ``x / (1 + expf(-x))`` with
the C library's expf.  Each fused multiply-add is one rounding here (LLVM's fma, as the AVX2 instruction), where the
numpy form's float64 emulation rounds twice a few times in 2^29.  In numpy a row took some thirty calls: a small
model's SWIGLU node cost about 90 microseconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import bits, expf, from_bits
from .compiled import fma32

F32 = np.float32

_R = F32(float.fromhex("0x1.8p23"))
_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_LN2_HI, _LN2_LO = F32(float.fromhex("0x1.62e4p-1")), F32(float.fromhex("0x1.7f7d1cp-20"))
_P0, _P1, _P2, _P3, _P4 = (F32(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3",
                                                           "0x1.fffdb6p-2", "0x1.ffffecp-1"))
_ONE_BITS = np.uint32(0x3F800000)
_SHIFT = np.uint32(23)


@njit(cache=True, inline="always")
def v_expf(x):  # type: ignore[no-untyped-def]
    """One lane of ggml_v_expf (AVX2 + FMA)."""
    z = fma32(x, _LOG2E, _R)
    n = F32(z - _R)
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    e = bits(z) << _SHIFT
    k = from_bits(e + _ONE_BITS)
    u = F32(b * b)
    j = fma32(fma32(fma32(_P0, b, _P1), u, fma32(_P2, b, _P3)), u, F32(_P4 * b))
    if not abs(n) > F32(126):
        return fma32(j, k, k)
    g = np.uint32(0x82000000) if n <= F32(0) else np.uint32(0)
    s1 = from_bits(g + np.uint32(0x7F000000))
    if abs(n) > F32(192):
        return F32(s1 * s1)
    s2 = from_bits(e - g)
    return F32(fma32(s2, j, s2) * s1)


@njit(cache=True, nogil=True, error_model="numpy")
def silu_rows(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out = SILU of every row of x (both float32 (rows, n)) as ggml_vec_silu_f32 computes it."""
    rows, n = x.shape
    whole = n - n % 8
    one, zero = F32(1), F32(0)
    for r in range(rows):
        xr, o = x[r], out[r]
        for i in range(whole):
            v = xr[i]
            o[i] = F32(v / F32(one + v_expf(F32(zero - v))))
        for i in range(whole, n):
            v = xr[i]
            o[i] = F32(v / F32(one + expf(-v)))
