"""CONV_TRANSPOSE_2D and CONV_2D_DW against direct scalar-loop definitions, on small cases with permuted
(non-contiguous) inputs and both kernel types."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_ops import filled, permuted, rand

F32, F16 = int(GgmlType.F32), int(GgmlType.F16)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 20)


@pytest.mark.parametrize("ktype, stride", [(F32, 1), (F16, 2)])
def test_conv_transpose_2d_scatters_every_tap(arena, ktype, stride):
    kw, kh, oc, ic, w, h, n = 2, 3, 2, 3, 4, 3, 2
    kern = rand(ic, oc, kh, kw).astype(np.float16).astype(np.float32)
    x = rand(n, ic, h, w, seed=1)
    kt = filled(arena, ktype, (kw, kh, oc, ic), kern)
    ow, oh = (w - 1) * stride + kw, (h - 1) * stride + kh
    out = arena.tensor(F32, (ow, oh, oc, n), op=GgmlOp.CONV_TRANSPOSE_2D, src=(kt, permuted(arena, x)),
                       params=params(stride))
    execute([out])
    xv = x.astype(np.float16).astype(np.float32) if ktype == F16 else x  # an F16 kernel multiplies F16 input
    want = np.zeros((n, oc, oh, ow))
    for b, i, y, xx, o, ky, kx in np.ndindex(n, ic, h, w, oc, kh, kw):
        want[b, o, y * stride + ky, xx * stride + kx] += xv[b, i, y, xx] * kern[i, o, ky, kx]
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ktype, s, p, d", [(F32, 1, 0, 1), (F16, 2, 1, 2)])
def test_conv_2d_dw_one_filter_per_channel(arena, ktype, s, p, d):
    kw, kh, c, w, h, n = 3, 2, 3, 7, 6, 2
    kern = rand(c, 1, kh, kw).astype(np.float16).astype(np.float32)
    x = rand(n, c, h, w, seed=1)
    ow, oh = (w + 2 * p - d * (kw - 1) - 1) // s + 1, (h + 2 * p - d * (kh - 1) - 1) // s + 1
    out = arena.tensor(F32, (ow, oh, c, n), op=GgmlOp.CONV_2D_DW,
                       src=(filled(arena, ktype, (kw, kh, 1, c), kern), permuted(arena, x)),
                       params=params(s, s, p, p, d, d))
    execute([out])
    want = np.zeros((n, c, oh, ow))
    for b, ch, oy, ox, ky, kx in np.ndindex(n, c, oh, ow, kh, kw):
        iy, ix = oy * s + ky * d - p, ox * s + kx * d - p
        if 0 <= iy < h and 0 <= ix < w:
            want[b, ch, oy, ox] += x[b, ch, iy, ix] * kern[ch, 0, ky, kx]
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-5, atol=1e-5)


def test_conv_2d_dw_refuses_a_kernel_with_more_than_one_input_channel(arena):
    kt = filled(arena, F32, (3, 3, 2, 4), rand(4, 2, 3, 3))
    xt = filled(arena, F32, (5, 5, 4, 1), rand(1, 4, 5, 5))
    out = arena.tensor(F32, (3, 3, 4, 1), op=GgmlOp.CONV_2D_DW, src=(kt, xt), params=params(1, 1, 0, 0, 1, 1))
    with pytest.raises(Exception, match="CONV_2D_DW: kernel must be"):
        execute([out])
