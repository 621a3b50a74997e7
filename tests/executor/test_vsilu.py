"""SILU as ggml's AVX2 build computes it (compiled, :mod:`.vsilu`) against the same steps written with numpy, lane
by lane: ggml_v_expf's polynomial for whole groups of eight, the C library's expf for a row's tail."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
from ggml_rpc.reference.executor.simd_math import silu_rows

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_C.expf.restype, _C.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _fma(a: np.ndarray, b: np.ndarray | F, c: np.ndarray | F) -> np.ndarray:
    # Exact product in float64, one rounding of the sum to float32 (a second rounding a few times in 2^29: the
    # values below were checked to have none).
    return (np.asarray(a, dtype=np.float64) * b + c).astype(F)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F).view(np.uint32)


def _float(u: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(u, dtype=np.uint32).view(F)


def _v_expf(x: np.ndarray) -> np.ndarray:
    r, log2e = F(float.fromhex("0x1.8p23")), F(float.fromhex("0x1.715476p+0"))
    hi, lo = F(float.fromhex("0x1.62e4p-1")), F(float.fromhex("0x1.7f7d1cp-20"))
    p = [F(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                       "0x1.ffffecp-1")]
    z = _fma(x, log2e, r)
    n = z - r
    b = _fma(-n, lo, _fma(-n, hi, x))
    e = _bits(z) << np.uint32(23)
    k = _float(e + np.uint32(0x3F800000))
    u = b * b
    j = _fma(_fma(_fma(p[0], b, p[1]), u, _fma(p[2], b, p[3])), u, p[4] * b)
    g = np.where(n <= F(0), np.uint32(0x82000000), np.uint32(0))
    s1, s2 = _float(g + np.uint32(0x7F000000)), _float(e - g)
    big = np.where(np.abs(n) > F(192), s1 * s1, _fma(s2, j, s2) * s1)
    return np.where(np.abs(n) > F(126), big, _fma(j, k, k)).astype(F)


def _silu_row(x: np.ndarray) -> np.ndarray:
    whole = len(x) - len(x) % 8
    out = np.empty_like(x)
    out[:whole] = x[:whole] / (F(1) + _v_expf(F(0) - x[:whole]))
    out[whole:] = [F(v / (F(1) + F(_C.expf(float(-v))))) for v in x[whole:]]
    return out


def test_silu_is_ggmls_vector_and_tail_arithmetic() -> None:
    r = np.random.default_rng(5)
    # Rows of lengths with and without a tail; values over the polynomial's range and beyond its limits (|x| near
    # and past 126 and 192 in log2 terms: exp overflowing and underflowing), signed zeros and infinities.
    x = (r.standard_normal((64, 301)) * 10.0 ** r.integers(-3, 3, (64, 301))).astype(F)
    x[0, :8] = [0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 140.0, -140.0]
    x[1, :4] = [np.inf, -np.inf, 1e30, -1e30]
    with np.errstate(all="ignore"):
        want = np.stack([_silu_row(row) for row in x])
        got = silu_rows(x)
        assert got.tobytes() == want.tobytes()
        for n in (1, 7, 8, 9, 16, 33):  # every tail length through the same function
            assert silu_rows(x[:3, :n]).tobytes() == np.stack([_silu_row(row) for row in x[:3, :n]]).tobytes()


def test_f16_silu_is_the_scalar_form_with_the_c_librarys_expf() -> None:
    """ggml's unary SILU on F16 converts each value to float32, takes x / (1 + expf(-x)) with the C library's expf
    and rounds back; these three F16 inputs are among those where numpy's exp would round to another F16."""
    from ggml_rpc.reference.executor import execute
    from ggml_rpc.reference.executor.arena import Arena, params
    from ggml_rpc.spec import GgmlOp, GgmlType, UnaryOp

    x = np.array([-6.9046021e-04, -7.1386719e-01, -2.7246094e+00, 0.5, -30.0, 3.0, -1.0, 8.0], dtype=np.float16)
    arena = Arena(1 << 12)
    a = arena.tensor(int(GgmlType.F16), (8,))
    arena.set(a, x.astype(F))
    out = arena.tensor(int(GgmlType.F16), (8,), op=GgmlOp.UNARY, src=(a,), params=params(int(UnaryOp.SILU)))
    execute([out])
    v = x.astype(F)
    want = np.array([F(t / (F(1) + F(_C.expf(float(-t))))) for t in v], dtype=F).astype(np.float16)
    assert arena.raw(out).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
