"""Convolutions with an F16 kernel multiply F16-rounded input, as ggml's CPU backend does (it lays the patches out,
or copies the input, in the kernel's type before the product). With the float32 input the reference used before,
its results differed from upstream's by NMSE up to 8e-7 in test-backend-ops' F16 cases."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_ops import filled, naive_conv, rand
from .test_ops_more import direct_conv_3d

F32, F16 = int(GgmlType.F32), int(GgmlType.F16)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _matches_rounded_input_only(got: np.ndarray, rounded: np.ndarray, unrounded: np.ndarray) -> None:
    scale = float(np.abs(rounded).max())
    np.testing.assert_allclose(got, rounded, rtol=0, atol=2e-6 * scale)
    # The rounding is visible at this size: the test tells the two computations apart.
    assert np.abs(got - unrounded).max() > 20 * 2e-6 * scale


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 20)


def test_conv_2d_f16_kernel_rounds_the_input(arena):
    x, k = rand(2, 8, 9, 10, seed=3), _half(rand(4, 8, 3, 3, seed=4))
    xi = filled(arena, F32, (10, 9, 8, 2), x)
    ki = filled(arena, F16, (3, 3, 8, 4), k.astype(np.float32))
    conv = arena.tensor(F32, (5, 5, 4, 2), op=GgmlOp.CONV_2D, src=(ki, xi), params=params(2, 2, 1, 1, 1, 1))
    execute([conv])
    rounded, unrounded = naive_conv(_half(x), k, 2, 1), naive_conv(x.astype(np.float64), k, 2, 1)
    _matches_rounded_input_only(arena.get(conv), rounded, unrounded)


def test_conv_3d_f16_kernel_rounds_the_input(arena):
    n, c, oc, s, p, d = 1, 6, 2, (1, 1, 1), (0, 0, 0), (1, 1, 1)
    x, kern = rand(n, c, 3, 4, 5, seed=5), _half(rand(oc, c, 2, 2, 3, seed=6))
    xt = filled(arena, F32, (5, 4, 3, n * c), x.reshape(n * c, 3, 4, 5))
    kt = filled(arena, F16, (3, 2, 2, oc * c), kern.reshape(oc * c, 2, 2, 3).astype(np.float32))
    _, rounded = direct_conv_3d(_half(x), kern, s, p, d)
    _, unrounded = direct_conv_3d(x.astype(np.float64), kern, s, p, d)
    od, oh, ow = rounded.shape[2:5]
    conv = arena.tensor(F32, (ow, oh, od, oc * n), op=GgmlOp.CONV_3D, src=(kt, xt), params=params(*s, *p, *d, c, n, oc))
    execute([conv])
    _matches_rounded_input_only(arena.get(conv).reshape(rounded.shape), rounded, unrounded)


def test_conv_transpose_2d_f16_kernel_rounds_the_input(arena):
    kw, kh, oc, ic, w, h, n, stride = 2, 2, 2, 8, 4, 3, 1, 1
    kern, x = _half(rand(ic, oc, kh, kw, seed=7)), rand(n, ic, h, w, seed=8)
    kt = filled(arena, F16, (kw, kh, oc, ic), kern.astype(np.float32))
    xt = filled(arena, F32, (w, h, ic, n), x)
    ow, oh = (w - 1) * stride + kw, (h - 1) * stride + kh
    out = arena.tensor(F32, (ow, oh, oc, n), op=GgmlOp.CONV_TRANSPOSE_2D, src=(kt, xt), params=params(stride))
    execute([out])

    def direct(xv: np.ndarray) -> np.ndarray:
        want = np.zeros((n, oc, oh, ow))
        for b, i, y, xx, o, ky, kx in np.ndindex(n, ic, h, w, oc, kh, kw):
            want[b, o, y * stride + ky, xx * stride + kx] += xv[b, i, y, xx] * kern[i, o, ky, kx]
        return want

    _matches_rounded_input_only(arena.get(out), direct(_half(x)), direct(x.astype(np.float64)))
