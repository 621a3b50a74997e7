"""SOFT_MAX against ggml_compute_forward_soft_max_f32 written out with numpy, row by row: scale, the mask times the
ALiBi slope fused into the row, the maximum (with the sink's), ggml's vector exp for whole groups of eight (each
group's float sum into a double) and the C library's expf for the rest, the sink's expf, the float of 1.0 / sum."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.softmax import alibi_slopes
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_vsilu import _v_expf

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_C.expf.restype, _C.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _row(x: np.ndarray, scale: F, mask: np.ndarray | None, slope: F, sink: F | None) -> np.ndarray:
    wp = (x * scale).astype(F)
    if mask is not None:
        wp = (np.float64(slope) * mask + wp).astype(F)  # fused: rounded once
    mx = F(-np.inf)
    for v in wp:
        mx = mx if mx > v else v
    if sink is not None:
        mx = mx if mx > sink else sink
    whole = len(wp) - len(wp) % 8
    out = np.empty_like(wp)
    total = np.float64(0)
    with np.errstate(over="ignore", invalid="ignore"):
        out[:whole] = _v_expf((wp[:whole] - mx).astype(F))
    for g in range(0, whole, 8):
        r = out[g + 4 : g + 8] + out[g : g + 4]
        total += np.float64((r[0] + r[2]) + (r[1] + r[3]))
    for i in range(whole, len(wp)):
        out[i] = F(_C.expf(float(F(wp[i] - mx))))
        total += np.float64(out[i])
    if sink is not None:
        total += np.float64(F(_C.expf(float(F(sink - mx)))))
    return (out * F(1.0 / total)).astype(F)


@pytest.mark.parametrize("seed", range(8))
def test_soft_max_is_ggmls_row_loop(seed: int) -> None:
    r = np.random.default_rng(seed)
    n0, n1, n2 = int(r.choice([5, 16, 37, 64])), 3, int(r.choice([2, 4, 16]))
    max_bias = 8.0 if seed % 2 else 0.0
    arena = Arena(1 << 18)
    x = arena.tensor(int(GgmlType.F32), (n0, n1, n2))
    arena.set(x, (r.standard_normal((1, n2, n1, n0)) * 4).astype(F))
    m = arena.tensor(int(GgmlType.F16), (n0, n1 + 2))
    mask = r.standard_normal((1, 1, n1 + 2, n0)).astype(F)
    mask[r.random(mask.shape) < 0.3] = -np.inf
    arena.set(m, mask)
    sinks = arena.tensor(int(GgmlType.F32), (n2,))
    arena.set(sinks, (r.standard_normal(n2) * 3).astype(F))
    use_sinks = seed % 3 == 0
    scale = F(0.37)
    out = arena.tensor(int(GgmlType.F32), (n0, n1, n2), op=GgmlOp.SOFT_MAX,
                       src=(x, m, sinks if use_sinks else None), params=params(float(scale), max_bias))
    execute([out])
    got, xs, ms = arena.get(out)[0], arena.get(x)[0], arena.get(m)[0, 0]
    slopes = alibi_slopes(n2, max_bias)
    for h in range(n2):
        for i in range(n1):
            want = _row(xs[h, i], scale, ms[i, :n0], slopes[h], arena.get(sinks).reshape(-1)[h] if use_sinks else None)
            assert got[h, i].tobytes() == want.tobytes(), (h, i)
