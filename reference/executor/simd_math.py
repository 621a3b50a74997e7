"""ggml's AVX2 vector math (``ggml_v_expf``, ``ggml_v_silu``), step for step in float32, so that SILU and SWIGLU
agree with upstream's bit for bit.

Upstream runs a row's elements eight at a time through these polynomial approximations and the last ``n % 8`` through
libm (``expf``, correctly rounded).  Their results differ from numpy's exp by an ulp now and then, which is enough to
change one of the next matmul's 8-bit activation codes.  Each fused multiply-add is computed in float64 (the float32
product is exact there) and rounded once to float32.
"""

from __future__ import annotations

import numpy as np

from .libm import expf
from .simd_sums import fma32

F = np.float32
_LANES = 8


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F).view(np.uint32)


def _float(u: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(u, dtype=np.uint32).view(F)


_R = F(float.fromhex("0x1.8p23"))
_LOG2E = F(float.fromhex("0x1.715476p+0"))
_LN2_HI, _LN2_LO = F(float.fromhex("0x1.62e4p-1")), F(float.fromhex("0x1.7f7d1cp-20"))
_P = [F(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                    "0x1.ffffecp-1")]
_ONE_BITS = np.uint32(0x3F800000)


def v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX2 + FMA) lane by lane, float32 in and out."""
    x = np.asarray(x, dtype=F)
    with np.errstate(over="ignore", invalid="ignore"):
        z = fma32(x, _LOG2E, _R)
        n = z - _R
        b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
        e = _bits(z) << np.uint32(23)
        k = _float(e + _ONE_BITS)
        c = np.abs(n) > F(126)
        u = b * b
        j = fma32(fma32(fma32(_P[0], b, _P[1]), u, fma32(_P[2], b, _P[3])), u, _P[4] * b)
        plain = fma32(j, k, k)
        if not c.any():
            return plain
        g = np.where(n <= F(0), np.uint32(0x82000000), np.uint32(0))
        s1 = _float(g + np.uint32(0x7F000000))
        s2 = _float(e - g)
        d = np.abs(n) > F(192)
        return np.where(d, s1 * s1, np.where(c, fma32(s2, j, s2) * s1, plain)).astype(F)


def v_silu(x: np.ndarray) -> np.ndarray:
    """ggml_v_silu: x / (1 + v_expf(0 - x)), float32."""
    x = np.asarray(x, dtype=F)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return x / (F(1) + v_expf(F(0) - x))


def silu_libm(x: np.ndarray) -> np.ndarray:
    """ggml_silu_f32: x / (1 + expf(-x)), with the C library's expf."""
    x = np.asarray(x, dtype=F)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return x / (F(1) + expf(-x))


def silu_rows(x: np.ndarray) -> np.ndarray:
    """SILU of every row (last axis) as ggml_vec_silu_f32 computes it: eight at a time through :func:`v_silu`, the
    row's last ``n % 8`` through :func:`silu_libm`."""
    x = np.asarray(x, dtype=F)
    n = x.shape[-1]
    whole = n - n % _LANES
    out = np.empty_like(x)
    out[..., :whole] = v_silu(x[..., :whole])
    out[..., whole:] = silu_libm(x[..., whole:])
    return out
