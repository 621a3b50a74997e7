"""DSV4_HC_COMB / PRE / POST, SUM of a permuted source and antialiased UPSCALE against element-by-element
formulations, on small cases with non-contiguous sources."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_ops import filled, permuted, rand

F32 = int(GgmlType.F32)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 20)


def comb_reference(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, eps: float, n_iter: int):
    """Per token: logits[dst][src], softmax over dst, then Sinkhorn rounds, in float64."""
    n_tok = mixes.shape[0]
    out = np.zeros((n_tok, hc, hc))  # (T, src, dst)
    for t in range(n_tok):
        p = np.zeros((hc, hc))  # [dst][src]
        for d in range(hc):
            for s in range(hc):
                m = 2 * hc + d + hc * s
                p[d, s] = mixes[t, m] * scale[2] + base[m]
        p = np.exp(p - p.max(axis=0)) / np.exp(p - p.max(axis=0)).sum(axis=0) + eps
        p = p / (p.sum(axis=1, keepdims=True) + eps)
        for _ in range(n_iter - 1):
            p = p / (p.sum(axis=0, keepdims=True) + eps)
            p = p / (p.sum(axis=1, keepdims=True) + eps)
        out[t] = p.T
    return out


@pytest.mark.parametrize("n_iter", [1, 5])
def test_hc_comb_is_a_normalised_softmax(arena, n_iter):
    hc, n_tok, eps = 3, 4, 1e-6
    width = (2 + hc) * hc
    mixes = rand(1, 1, n_tok, width)
    scale, base = rand(3, seed=1), rand(width, seed=2)
    mt = permuted(arena, mixes)
    st, bt = filled(arena, F32, (3,), scale), filled(arena, F32, (width,), base)
    out = arena.tensor(F32, (hc, hc, n_tok), op=GgmlOp.DSV4_HC_COMB, src=(mt, st, bt), params=params(eps, n_iter))
    execute([out])
    want = comb_reference(mixes[0, 0].astype(np.float64), scale, base, hc, eps, n_iter)
    np.testing.assert_allclose(arena.get(out)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_hc_pre_weights_or_sigmoid_gate(arena, gated):
    n_embd, hc, n_tok = 5, 3, 2
    x = rand(1, n_tok, hc, n_embd)
    w = rand(1, n_tok, hc, n_embd, seed=1) if gated else rand(1, 1, n_tok, hc, seed=1)
    xt = permuted(arena, x)
    wt = permuted(arena, w)
    scale = 0.5 if gated else 1.0
    out = arena.tensor(F32, (n_embd, n_tok), op=GgmlOp.DSV4_HC_PRE, src=(xt, wt), params=params(scale, int(gated)))
    execute([out])
    want = np.zeros((n_tok, n_embd))
    for t in range(n_tok):
        for i in range(n_embd):
            for h in range(hc):
                f = 1 / (1 + np.exp(-float(w[0, t, h, i]))) if gated else float(w[0, 0, t, h])
                want[t, i] += float(x[0, t, h, i]) * f
    np.testing.assert_allclose(arena.get(out)[0, 0], want * scale, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("identity", [False, True])
def test_hc_post_spreads_over_streams(arena, identity):
    n_embd, hc, n_tok = 4, 3, 2
    x, res, post = rand(1, 1, n_tok, n_embd), rand(1, n_tok, hc, n_embd, seed=1), rand(1, 1, n_tok, hc, seed=2)
    comb = rand(1, n_tok, hc, hc, seed=3)  # (T, src, dst)
    srcs = [permuted(arena, x), permuted(arena, res), permuted(arena, post)]
    if not identity:
        srcs.append(permuted(arena, comb))
    out = arena.tensor(F32, (n_embd, hc, n_tok), op=GgmlOp.DSV4_HC_POST, src=tuple(srcs))
    execute([out])
    want = np.zeros((n_tok, hc, n_embd))
    for t in range(n_tok):
        for d in range(hc):
            for i in range(n_embd):
                mix = res[0, t, d, i] if identity else sum(res[0, t, s, i] * comb[0, t, s, d] for s in range(hc))
                want[t, d, i] = x[0, 0, t, i] * post[0, 0, t, d] + mix
    np.testing.assert_allclose(arena.get(out)[0], want, rtol=1e-5, atol=1e-6)


def test_hc_pre_refuses_a_gate_of_the_wrong_shape(arena):
    xt = filled(arena, F32, (4, 2, 3), rand(1, 3, 2, 4))
    wt = filled(arena, F32, (2, 3), rand(1, 1, 3, 2))
    out = arena.tensor(F32, (4, 3), op=GgmlOp.DSV4_HC_PRE, src=(xt, wt), params=params(1.0, 1))
    with pytest.raises(Exception, match="DSV4_HC_PRE: shapes"):
        execute([out])


def test_sum_of_a_source_permuted_in_dims_0_1_reads_rows_from_their_start(arena):
    # ggml's CPU SUM adds ne0 consecutive elements from each row's first element, whatever nb0 is: for a view
    # [33, 4] with nb0 = 16 and nb1 = 4 bytes over memory m, that is sum over rows r of m[r : r + 33].
    view = permuted(arena, rand(1, 1, 4, 33))
    m = arena.get(arena.view_of(view, (4 * 33,), (4, 528, 528, 528))).reshape(-1).astype(np.float64)
    out = arena.tensor(F32, (1,), op=GgmlOp.SUM, src=(view,))
    execute([out])
    want = sum(m[r : r + 33].sum() for r in range(4))
    assert want != pytest.approx(m.sum(), rel=1e-3)  # the case tells the two readings apart
    assert arena.get(out).item() == pytest.approx(want, rel=1e-5)


def aa_weights_1d(n_in: int, n_out: int) -> np.ndarray:
    """Antialiased bilinear weights, one output at a time: the triangle widened by the shrink factor, and the
    weights that fall inside the source divided by their sum."""
    ratio = n_in / n_out
    support = max(ratio, 1.0)
    w = np.zeros((n_out, n_in))
    for o in range(n_out):
        centre = (o + 0.5) * ratio
        for j in range(n_in):
            w[o, j] = max(0.0, 1.0 - abs(j + 0.5 - centre) / support)
        w[o] /= w[o].sum()
    return w


@pytest.mark.parametrize("src_ne, dst_ne", [((6, 5, 2, 1), (3, 2, 2, 1)), ((2, 3, 1, 2), (5, 4, 1, 2))])
def test_upscale_antialiased_bilinear(arena, src_ne, dst_ne):
    x = rand(src_ne[3], src_ne[2], src_ne[1], src_ne[0])
    xt = permuted(arena, x)
    out = arena.tensor(F32, dst_ne, op=GgmlOp.UPSCALE, src=(xt,), params=params(1 | (1 << 9)))
    execute([out])
    w0, w1 = aa_weights_1d(src_ne[0], dst_ne[0]), aa_weights_1d(src_ne[1], dst_ne[1])
    want = np.zeros((dst_ne[3], dst_ne[2], dst_ne[1], dst_ne[0]))
    for i3, i2, i1, i0 in np.ndindex(*want.shape):
        want[i3, i2, i1, i0] = sum(w1[i1, j1] * w0[i0, j0] * x[i3, i2, j1, j0]
                                   for j1 in range(src_ne[1]) for j0 in range(src_ne[0]))
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-5, atol=1e-6)


def test_hc_comb_bounds_the_sinkhorn_rounds_a_peer_asks_for(arena):
    hc, width = 2, 8
    mt, st, bt = (filled(arena, F32, (width,), rand(1, 1, 1, width)), filled(arena, F32, (3,), rand(1, 1, 1, 3)),
                  filled(arena, F32, (width,), rand(1, 1, 1, width, seed=1)))
    out = arena.tensor(F32, (hc, hc, 1), op=GgmlOp.DSV4_HC_COMB, src=(mt, st, bt), params=params(1e-6, 1 << 30))
    with pytest.raises(Exception, match="n_iter 1073741824 must be in"):
        execute([out])
