"""ROPE bit for bit against ggml's rope written out per value in Python: the angle recurrence, frequency factors,
YaRN's ramp and magnitude (its mix and 1 + 0.1 logf(1 / freq_scale) with their first product fused), the C
library's cosf/sinf/logf and the rotation with its first product fused (as upstream's build computes it, measured
against its ROPE results: test-backend-ops' YaRN cases replay bit for bit)."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.rope import yarn_corr_dims
from ggml_rpc.spec import GgmlOp, GgmlType

F = np.float32
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("cosf", "sinf", "powf", "logf"):
    getattr(_C, _name).restype = ctypes.c_float
_C.cosf.argtypes = _C.sinf.argtypes = _C.logf.argtypes = [ctypes.c_float]
_C.powf.argtypes = [ctypes.c_float, ctypes.c_float]


def _fma(a: F, b: F, c: F) -> F:
    return F(np.float64(a) * np.float64(b) + np.float64(c))


def _rope_row(x: np.ndarray, pos: int, n_dims: int, neox: bool, base: float, fs: float, ext: float, attn: float,
              ff: np.ndarray | None, sign: float) -> np.ndarray:
    out = x.copy()
    theta_scale = F(_C.powf(base, float(F(-2.0) / F(n_dims))))
    low, high = yarn_corr_dims(n_dims, 64, base, 32.0, 1.0)
    mscale = F(attn)
    if ext:
        mscale = F(mscale * _fma(F(0.1), F(_C.logf(float(F(1) / F(fs)))), F(1)))  # fused, logf the library's
    theta = F(pos)
    for i in range(n_dims // 2):
        t = theta if ff is None else F(theta / ff[i])
        interp = F(F(fs) * t)
        if ext:
            y = F(F(F(i) - low) / max(F(0.001), F(high - low)))
            ramp = F(F(F(1) - min(F(1), max(F(0), y))) * F(ext))
            t = _fma(interp, F(F(1) - ramp), F(t * ramp))  # the first product fused into the sum
        else:
            t = interp
        c, s = F(F(_C.cosf(float(t))) * mscale), F(F(F(_C.sinf(float(t))) * mscale) * F(sign))
        a, b = (i, i + n_dims // 2) if neox else (2 * i, 2 * i + 1)
        out[a] = _fma(x[a], c, -F(x[b] * s))
        out[b] = _fma(x[a], s, F(x[b] * c))
        theta = F(theta * theta_scale)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_rope_is_ggmls_loop_bit_for_bit(seed: int) -> None:
    r = np.random.default_rng(seed)
    head, n_head, n_tok = int(r.choice([8, 32, 64])), 2, 3
    n_dims = int(r.choice([head // 2, head]))
    neox, ext, back = bool(seed % 2), float(r.choice([0.0, 1.0])), seed % 3 == 0
    fs, base = float(r.choice([1.0, 0.25])), float(r.choice([10000.0, 1e6]))
    arena = Arena(1 << 16)
    x = (r.standard_normal((1, n_tok, n_head, head)) * 3).astype(F)
    a = arena.tensor(GgmlType.F32, (head, n_head, n_tok))
    arena.set(a, x)
    positions = r.integers(0, 5000, n_tok).astype(np.int32)
    pos = arena.tensor(GgmlType.I32, (n_tok,))
    arena.set_raw(pos, positions)
    ff_vals = None
    srcs = [a, pos]
    if seed % 4 == 1:
        ff_vals = (r.random(head // 2) * 3 + 0.5).astype(F)
        ff = arena.tensor(GgmlType.F32, (head // 2,))
        arena.set(ff, ff_vals)
        srcs.append(ff)
    p = params(0, n_dims, 2 if neox else 0, 0, 64, base, fs, ext, 0.7, 32.0, 1.0)
    out = arena.tensor(GgmlType.F32, (head, n_head, n_tok), op=GgmlOp.ROPE_BACK if back else GgmlOp.ROPE,
                       src=tuple(srcs), params=p)
    execute([out])
    got = arena.get(out)
    for t, h in np.ndindex(n_tok, n_head):
        want = _rope_row(x[0, t, h], int(positions[t]), n_dims, neox, base, fs, ext, 0.7, ff_vals,
                         -1.0 if back else 1.0)
        assert got[0, t, h].tobytes() == want.tobytes(), (t, h)
