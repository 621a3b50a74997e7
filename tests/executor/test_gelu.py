"""GELU and quick GELU by source type, as ggml's CPU backend computes them: F32 through the F16 tables with GELU's
clamps at -10 and 10, F16 straight from the tables, BF16 by the formula value by value (no table)."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.gelu import gelu_quick_table, gelu_table
from ggml_rpc.spec import GgmlOp, GgmlType, UnaryOp

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_C.tanhf.restype, _C.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
_C.expf.restype, _C.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _formula(x: F) -> F:
    inner = F(np.float64(F(F(0.044715) * x)) * np.float64(x) + 1.0)  # ggml's compiler fuses this product
    th = F(_C.tanhf(float(F(F(F(0.79788456080286535587989211986876) * x) * inner))))
    return F(F(F(0.5) * x) * F(F(1) + th))


def _unary(type_id: int, values: np.ndarray, sub: UnaryOp) -> np.ndarray:
    arena = Arena(1 << 14)
    a = arena.tensor(type_id, (len(values),))
    arena.set(a, values)
    out = arena.tensor(type_id, (len(values),), op=GgmlOp.UNARY, src=(a,), params=params(int(sub)))
    execute([out])
    return arena.raw(out).reshape(-1).copy()


def test_the_f16_table_holds_the_formula_rounded_to_f16() -> None:
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F)
    for i in np.random.default_rng(0).choice(np.flatnonzero(np.isfinite(halves)), 500, replace=False):
        x = halves[i]
        assert gelu_table()[i] == F(np.float16(_formula(x))), x
        with np.errstate(over="ignore"):
            quick = F(x * F(F(1) / F(F(1) + F(_C.expf(float(F(F(-1.702) * x)))))))
            assert gelu_quick_table()[i] == F(np.float16(quick)), x


def test_f32_clamps_f16_does_not_and_bf16_takes_the_formula() -> None:
    x = np.array([-12.0, -10.0, -3.3, -0.4, 0.7, 2.5, 9.9, 12.0], dtype=F)
    got32 = _unary(int(GgmlType.F32), x, UnaryOp.GELU).view(F)
    assert got32[0] == 0 and not np.signbit(got32[0]) and got32[-1] == F(12)  # ggml_vec_gelu_f32's clamps
    got16 = _unary(int(GgmlType.F16), x, UnaryOp.GELU).view(np.float16)
    assert np.signbit(got16[0]) and got16[0] == 0  # the table's own value: -0 from 0.5 x (1 + tanh), no clamp
    brains = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F)  # the inputs as BF16 holds them
    gotb = (_unary(int(GgmlType.BF16), brains, UnaryOp.GELU).astype(np.uint32) << np.uint32(16)).view(F)
    want = np.array([_formula(v) for v in brains], dtype=F)
    want_b = ((want.view(np.uint32) + np.uint32(0x7FFF) + ((want.view(np.uint32) >> 16) & 1)) >> 16 << 16).view(F)
    assert gotb.tobytes() == want_b.tobytes()


@pytest.mark.parametrize("sub", [UnaryOp.GELU, UnaryOp.GELU_QUICK])
def test_bf16_never_reads_the_f16_table(sub: UnaryOp) -> None:
    # Values where the F16-table route and the formula give different BF16 results: the table rounds the input to
    # F16 first (a BF16 value with more than F16's exponent range, or between F16 steps, moves).
    x = np.array([1e-6, 3.0e-5, 0.1234, 70000.0, -1e-7, 5.5], dtype=F)
    brains = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F)
    table_route = _unary(int(GgmlType.F32), brains, sub).view(F)
    gotb = (_unary(int(GgmlType.BF16), brains, sub).astype(np.uint32) << np.uint32(16)).view(F)
    assert not np.array_equal(gotb, (table_route.view(np.uint32) & np.uint32(0xFFFF0000)).view(F))
