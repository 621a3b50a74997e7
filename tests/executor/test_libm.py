"""The executor's expf, cosf, sinf and powf give the C library's own results (what upstream's kernels call),
element for element, although most elements never reach the library."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import libm

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("expf", "cosf", "sinf"):
    getattr(_C, _name).restype, getattr(_C, _name).argtypes = ctypes.c_float, [ctypes.c_float]
_C.powf.restype, _C.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]


@pytest.mark.parametrize(("name", "scale"), [("expf", 20.0), ("cosf", 300.0), ("sinf", 300.0)])
def test_every_element_is_the_libraries(name: str, scale: float) -> None:
    x = (np.random.default_rng(7).standard_normal(100_000) * scale).astype(F)
    x[:4] = [0.0, -0.0, 88.8, -104.0]  # zero and the edges of expf's range
    want = np.array([getattr(_C, name)(float(v)) for v in x], dtype=F)
    got = getattr(libm, name)(x)
    assert got.tobytes() == want.tobytes()
    # The library's values differ from the correctly rounded ones for some of these: the test tells them apart.
    wide = {"expf": np.exp, "cosf": np.cos, "sinf": np.sin}[name](x.astype(np.float64))
    with np.errstate(over="ignore"):
        assert (wide.astype(F) != want).any()


def test_powf_is_the_libraries() -> None:
    for n_dims in (32, 48, 64, 96, 128):
        assert libm.powf(10000.0, F(-2.0) / F(n_dims)) == F(_C.powf(10000.0, float(F(-2.0) / F(n_dims))))
