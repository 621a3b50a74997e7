"""K-quant quantisers (Q2_K..Q6_K): the vectorised scale searches against plain per-element float32 loops of the
same searches, round trips, hand-checkable degenerate blocks, and (with the upstream peers installed) bit-for-bit
agreement with ggml's CPU backend on thousands of random super-blocks."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import kquant as kq
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.spec import TYPES

F = np.float32
K_TYPES = (ty.Q2_K, ty.Q3_K, ty.Q4_K, ty.Q5_K, ty.Q6_K)


def loop_qkx2(x, w, nmax, rmin, rdelta, nstep, mad):
    """One sub-block, element by element, every operation rounded to float32."""
    n = len(x)
    mn, mx, sw, sx = x[0], x[0], w[0], F(w[0] * x[0])
    for i in range(1, n):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sw, sx = F(sw + w[i]), F(sx + F(w[i] * x[i]))
    mn = min(mn, F(0))
    if mx == mn:
        return F(0), F(-mn), [0] * n

    def err(scale, m, codes):
        e = F(0)
        for i in range(n):
            d = F(F(F(scale * F(codes[i])) + m) - x[i])
            e = F(e + F(w[i] * (abs(d) if mad else F(d * d))))
        return e

    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    codes = [max(0, min(nmax, int(np.rint(F(iscale * F(x[i] - mn)))))) for i in range(n)]
    best = err(scale, mn, codes)
    for s in range(nstep + 1):
        iscale = F(F(F(F(rmin) + F(F(rdelta) * F(s))) + F(nmax)) / F(mx - mn))
        aux = [max(0, min(nmax, int(np.rint(F(iscale * F(x[i] - mn)))))) for i in range(n)]
        sl = sl2 = sxl = F(0)
        for i in range(n):
            wl = F(w[i] * F(aux[i]))
            sl, sl2, sxl = F(sl + wl), F(sl2 + F(wl * F(aux[i]))), F(sxl + F(wl * x[i]))
        det = F(F(sw * sl2) - F(sl * sl))
        if det > 0:
            ts = F(F(F(sw * sxl) - F(sx * sl)) / det)
            tm = F(F(F(sl2 * sx) - F(sl * sxl)) / det)
            if tm > 0:
                tm, ts = F(0), F(sxl / sl2)
            cur = err(ts, tm, aux)
            if cur < best:
                codes, best, scale, mn = aux, cur, ts, tm
    return scale, F(-mn), codes


def loop_q3(x, nmax):
    n = len(x)
    j = int(np.argmax(np.abs(x)))
    if abs(x[j]) < 1e-15:
        return F(0), [0] * n
    iscale = F(F(-nmax) / x[j])
    lv = [max(-nmax, min(nmax - 1, int(np.rint(F(iscale * x[i]))))) for i in range(n)]
    w = [F(v * v) for v in x]
    slx_all = sl2_all = F(0)
    for i in range(n):
        slx_all = F(slx_all + F(F(w[i] * x[i]) * F(lv[i])))
        sl2_all = F(sl2_all + F(F(w[i] * F(lv[i])) * F(lv[i])))
    for _ in range(5):
        changed = 0
        for i in range(n):
            slx = F(slx_all - F(F(w[i] * x[i]) * F(lv[i])))
            if slx > 0:
                sl2 = F(sl2_all - F(F(w[i] * F(lv[i])) * F(lv[i])))
                new = max(-nmax, min(nmax - 1, int(np.rint(F(F(x[i] * sl2) / slx)))))
                if new != lv[i]:
                    slx = F(slx + F(F(w[i] * x[i]) * F(new)))
                    sl2 = F(sl2 + F(F(w[i] * F(new)) * F(new)))
                    if sl2 > 0 and F(F(slx * slx) * sl2_all) > F(F(slx_all * slx_all) * sl2):
                        lv[i], slx_all, sl2_all = new, slx, sl2
                        changed += 1
        if not changed:
            break
    return (F(slx_all / sl2_all) if sl2_all > 0 else F(0)), [v + nmax for v in lv]


def sub_blocks(n: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, size)) * rng.uniform(0.01, 3, (n, size))).astype(F)
    x[0] = 0
    x[1] = np.abs(x[1])  # all non-negative: the minimum clamps to 0
    x[2] = rng.uniform(-1, 1, size).round(1)  # ties
    return x


@pytest.mark.parametrize(("nmax", "rmin", "nstep", "mad", "size"),
                         [(3, -0.5, 15, True, 16), (15, -1.0, 20, False, 32), (31, -0.5, 15, False, 32)])
def test_qkx2_search_matches_element_loop(nmax, rmin, nstep, mad, size):
    x = sub_blocks(24, size, nmax)
    w = np.abs(x) + F(0.3)
    scale, mins, codes = kq.make_qkx2(x, w, nmax, rmin, 0.1, nstep, mad)
    for r in range(x.shape[0]):
        s, m, c = loop_qkx2(x[r], w[r], nmax, rmin, 0.1, nstep, mad)
        assert (scale[r], mins[r], codes[r].tolist()) == (s, m, c), r


def test_q3_refinement_matches_element_loop():
    x = sub_blocks(40, 16, 3)
    scale, codes = kq.make_q3(x, 4)
    for r in range(x.shape[0]):
        s, c = loop_q3(x[r], 4)
        assert (scale[r], codes[r].tolist()) == (s, c), r


@pytest.mark.parametrize("t", K_TYPES)
def test_zero_super_block_is_all_zero_values(t):
    blocks = ty.quantize(t, np.zeros((1, 256), F))
    assert not ty.dequantize(t, blocks).any()


@pytest.mark.parametrize(("t", "max_nmse"), [(ty.Q2_K, 0.12), (ty.Q3_K, 0.05), (ty.Q4_K, 0.012), (ty.Q5_K, 3e-3),
                                             (ty.Q6_K, 1e-3)])
def test_round_trip_error_is_bounded(t, max_nmse):
    x = np.random.default_rng(8).standard_normal((16, 512)).astype(F)
    back = ty.through_type(t, x)
    assert float(((back - x) ** 2).sum() / (x**2).sum()) < max_nmse


def test_q6_k_constant_block_bytes():
    # 1.0 everywhere: each sub-block fits 1.0 = -1/32 * (code 0 - 32), exactly; the super-scale d = 1/4096 stores
    # every sub-scale -1/32 as -128, and the codes are re-picked as 0.
    blocks = ty.quantize(ty.Q6_K, np.ones((1, 256), F))
    raw = blocks.reshape(-1)
    assert (raw[192:208].view(np.int8) == -128).all()
    assert not raw[0:192].any()
    assert raw[208:210].tobytes() == np.float16(1 / 4096).tobytes()
    assert (ty.dequantize(ty.Q6_K, blocks) == 1.0).all()


@pytest.fixture(scope="module")
def oracle(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


@pytest.mark.upstream
@pytest.mark.parametrize("t", K_TYPES)
def test_k_quants_match_ggml_bit_for_bit(oracle, t):
    nb = 1500
    x = sub_blocks(nb, 256, t).reshape(-1)
    x[768:1024] = np.float32(1e-3) * x[768:1024]
    ours = ty.quantize(t, x.reshape(1, -1)).reshape(nb, TYPES[t].size)
    assert np.array_equal(ours, oracle.from_float(t, x))
