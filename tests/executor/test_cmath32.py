"""The compiled kernels' expf, cosf, sinf and tanhf are the C library's (what upstream's kernels call), and their F16
rounding is a conversion to F16 and back, for every value tried."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import cmath32
from numba import njit

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("expf", "cosf", "sinf", "tanhf"):
    getattr(_C, _name).restype, getattr(_C, _name).argtypes = ctypes.c_float, [ctypes.c_float]


def _over(fn):  # type: ignore[no-untyped-def]
    @njit
    def apply(x, out):  # type: ignore[no-untyped-def]
        for i in range(x.size):
            out[i] = fn(x[i])

    def run(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        apply(x, out)
        return out

    return run


@pytest.mark.parametrize(("name", "scale"), [("expf", 20.0), ("cosf", 300.0), ("sinf", 300.0), ("tanhf", 3.0)])
def test_every_value_is_the_libraries(name: str, scale: float) -> None:
    x = (np.random.default_rng(11).standard_normal(100_000) * scale).astype(F)
    x[:6] = [0.0, -0.0, 88.8, -104.0, np.inf, -np.inf]
    want = np.array([getattr(_C, name)(float(v)) for v in x], dtype=F)
    got = _over(getattr(cmath32, name))(x)
    assert got.tobytes() == want.tobytes()
    # The library differs from the correctly rounded value for some of these: the test can tell the two apart.
    wide = {"expf": np.exp, "cosf": np.cos, "sinf": np.sin, "tanhf": np.tanh}[name](x[6:].astype(np.float64))
    with np.errstate(over="ignore"):
        assert (wide.astype(F) != want[6:]).any()


def test_half_rounding_is_a_round_trip_through_f16() -> None:
    r = np.random.default_rng(3)
    # Every F16 value, the midpoints between neighbours (ties both ways), values around them, the subnormal and
    # overflow edges, and random float32 values over F16's whole range and beyond.
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F)
    halves = halves[np.isfinite(halves)]
    ordered = np.unique(halves)
    mids = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(F)
    near = np.concatenate([np.nextafter(mids, F(np.inf)), np.nextafter(mids, F(-np.inf))])
    edges = np.array([65504, 65519.99, 65520, 65536, 1e30, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-30,
                      np.inf, -np.inf], dtype=F)
    wild = (r.standard_normal(200_000) * np.exp2(r.integers(-30, 20, 200_000))).astype(F)
    x = np.concatenate([halves, mids, near, edges, -edges, wild])
    got = _over(cmath32.to_half)(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(F)
    assert got.tobytes() == want.tobytes()
    nan = _over(cmath32.to_half)(np.array([np.nan], dtype=F))
    assert np.isnan(nan).all()
