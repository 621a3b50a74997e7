"""Backward and training ops against independent numpy formulations (finite differences of the forward ops where
that is the plain definition), on small cases with non-contiguous sources."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_ops import filled, permuted, rand

F32, I32, I64 = int(GgmlType.F32), int(GgmlType.I32), int(GgmlType.I64)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 20)


def numeric_grad(f, x, dy, h=1e-6):
    """d/dx of sum(f(x) * dy), by central differences in float64 (rows of x are independent)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        g[i] = ((f(xp) - f(xm)) * dy).sum() / (2 * h)
    return g


def test_silu_back_and_rms_norm_back_match_numeric_derivatives(arena):
    x = rand(1, 1, 2, 5).astype(np.float64)
    dy = rand(1, 1, 2, 5, seed=1).astype(np.float64)
    xt, dyt = permuted(arena, x.astype(np.float32)), filled(arena, F32, (5, 2), dy.astype(np.float32))
    eps = 1e-5
    silu = arena.tensor(F32, (5, 2), op=GgmlOp.SILU_BACK, src=(dyt, xt))
    rms = arena.tensor(F32, (5, 2), op=GgmlOp.RMS_NORM_BACK, src=(dyt, xt), params=params(eps))
    execute([silu, rms])
    np.testing.assert_allclose(arena.get(silu), numeric_grad(lambda v: v / (1 + np.exp(-v)), x, dy), rtol=1e-4,
                               atol=1e-6)
    norm = lambda v: v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)  # noqa: E731
    np.testing.assert_allclose(arena.get(rms), numeric_grad(norm, x, dy), rtol=1e-4, atol=1e-5)


def test_soft_max_back_matches_the_numeric_derivative(arena):
    z = rand(1, 1, 3, 4).astype(np.float64)
    dy = rand(1, 1, 3, 4, seed=2).astype(np.float64)
    scale = 0.5

    def softmax(v):
        e = np.exp(scale * v - (scale * v).max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    yt = filled(arena, F32, (4, 3), softmax(z).astype(np.float32))
    dyt = filled(arena, F32, (4, 3), dy.astype(np.float32))
    out = arena.tensor(F32, (4, 3), op=GgmlOp.SOFT_MAX_BACK, src=(dyt, yt), params=params(scale, 0.0))
    execute([out])
    np.testing.assert_allclose(arena.get(out), numeric_grad(softmax, z, dy), rtol=1e-4, atol=1e-6)


def test_repeat_back_sums_the_tiles(arena):
    x = rand(2, 1, 6, 4)  # a [4, 6, 1, 2] repeat of [2, 3, 1, 1]
    a = permuted(arena, x)
    out = arena.tensor(F32, (2, 3, 1, 1), op=GgmlOp.REPEAT_BACK, src=(a,))
    execute([out])
    want = x.reshape(2, 1, 1, 1, 2, 3, 2, 2).sum(axis=(0, 2, 4, 6))
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-6)


def test_get_rows_back_accumulates_repeated_indices(arena):
    g = rand(1, 1, 4, 3)
    gt = filled(arena, F32, (3, 4), g)
    idx = arena.tensor(I32, (3,))  # only the first three gradient rows are read
    arena.set_raw(idx, np.array([2, 0, 2], np.int32))
    shape = arena.tensor(F32, (3, 5))
    out = arena.tensor(F32, (3, 5), op=GgmlOp.GET_ROWS_BACK, src=(gt, idx, shape))
    execute([out])
    want = np.zeros((5, 3), np.float32)
    want[2] = g[0, 0, 0] + g[0, 0, 2]
    want[0] = g[0, 0, 1]
    np.testing.assert_allclose(arena.get(out)[0, 0], want, rtol=1e-6)


def test_count_equal_and_cross_entropy(arena):
    a = arena.tensor(I32, (5, 2))
    b = arena.tensor(I32, (5, 2))
    arena.set_raw(a, np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], np.int32).reshape(1, 1, 2, 5))
    arena.set_raw(b, np.array([1, 0, 3, 0, 5, 6, 0, 8, 0, 10], np.int32).reshape(1, 1, 2, 5))
    cnt = arena.tensor(I64, (1,), op=GgmlOp.COUNT_EQUAL, src=(a, b))
    logits = rand(1, 1, 3, 4)
    labels = np.abs(rand(1, 1, 3, 4, seed=3))
    labels /= labels.sum(-1, keepdims=True)
    lt, bt = filled(arena, F32, (4, 3), logits), filled(arena, F32, (4, 3), labels)
    loss = arena.tensor(F32, (1,), op=GgmlOp.CROSS_ENTROPY_LOSS, src=(lt, bt))
    gt = filled(arena, F32, (1,), np.array([[[[2.0]]]], np.float32))
    back = arena.tensor(F32, (4, 3), op=GgmlOp.CROSS_ENTROPY_LOSS_BACK, src=(gt, lt, bt))
    execute([cnt, loss, back])
    assert int(arena.raw(cnt).reshape(-1)[0]) == 6
    z = logits.astype(np.float64)

    def ce(v):
        ls = v - np.log(np.exp(v).sum(-1, keepdims=True))
        return -(labels * ls).sum() / 3

    np.testing.assert_allclose(arena.get(loss).reshape(-1)[0], ce(z), rtol=1e-5)
    np.testing.assert_allclose(arena.get(back), 2.0 * numeric_grad(ce, z, np.ones(())), rtol=1e-4, atol=1e-6)


def test_ssm_conv_and_col2im_1d_against_loops(arena):
    d_conv, d_inner, n_t, n_s = 4, 3, 5, 2
    sx = rand(1, n_s, d_inner, d_conv - 1 + n_t)
    c = rand(1, 1, d_inner, d_conv, seed=1)
    sxt, ct = filled(arena, F32, (d_conv - 1 + n_t, d_inner, n_s), sx), filled(arena, F32, (d_conv, d_inner), c)
    conv = arena.tensor(F32, (d_inner, n_t, n_s), op=GgmlOp.SSM_CONV, src=(sxt, ct))
    k, oc, t_in, s0, p0 = 3, 2, 4, 2, 1
    cols = rand(1, 1, t_in, k * oc, seed=2)
    colt = filled(arena, F32, (k * oc, t_in), cols)
    t_out = (t_in - 1) * s0 + k - 2 * p0
    c2i = arena.tensor(F32, (t_out, oc), op=GgmlOp.COL2IM_1D, src=(colt,), params=params(s0, oc, p0))
    execute([conv, c2i])
    want = np.zeros((n_s, n_t, d_inner))
    for s in range(n_s):
        for t in range(n_t):
            for i in range(d_inner):
                want[s, t, i] = (sx[0, s, i, t:t + d_conv] * c[0, 0, i]).sum()
    np.testing.assert_allclose(arena.get(conv)[0], want, rtol=1e-5, atol=1e-6)
    full = np.zeros((oc, (t_in - 1) * s0 + k))
    for t in range(t_in):
        for o in range(oc):
            full[o, t * s0: t * s0 + k] += cols[0, 0, t, o * k:(o + 1) * k]
    np.testing.assert_allclose(arena.get(c2i)[0, 0], full[:, p0:p0 + t_out], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k_type", [F32, int(GgmlType.Q8_0)])
def test_lightning_indexer_against_a_loop(arena, k_type):
    d, nh, nt, nkv, nb = 32, 3, 2, 5, 2
    q = rand(nb, nt, nh, d)
    k = rand(nb, nkv, 1, d, seed=1)
    w = rand(nb, 1, nt, nh, seed=2)
    mask = np.where(rand(1, 1, nt, nkv, seed=3) > 1.0, -np.inf, 0).astype(np.float16)
    qt = filled(arena, F32, (d, nh, nt, nb), q)
    kt = filled(arena, k_type, (d, 1, nkv, nb), k)
    wt = filled(arena, F32, (nh, nt, 1, nb), w)
    mt = arena.tensor(int(GgmlType.F16), (nkv, nt, 1, 1))
    arena.set_raw(mt, mask)
    out = arena.tensor(F32, (nkv, nt, 1, nb), op=GgmlOp.LIGHTNING_INDEXER, src=(qt, kt, wt, mt))
    execute([out])
    kk = arena.get(kt)[:, :, 0]  # keys as stored (quantised keys read back dequantised)
    qq = q  # float32 whatever the keys' type: ggml converts each key row, never the queries
    want = np.zeros((nb, nt, nkv))
    for b in range(nb):
        for t in range(nt):
            for s in range(nkv):
                want[b, t, s] = sum(w[b, 0, t, h] * max(0.0, float(qq[b, t, h] @ kk[b, s])) for h in range(nh))
    want += mask[0, 0].astype(np.float64)
    np.testing.assert_allclose(arena.get(out)[:, 0], want, rtol=1e-6, atol=1e-6)


def test_solve_tri_solves_the_lower_triangle_only(arena):
    n, k = 6, 3
    a = rand(2, 1, n, n) + 4 * np.eye(n, dtype=np.float32)  # well-conditioned; the upper triangle is noise
    b = rand(2, 1, n, k, seed=1)
    at, bt = filled(arena, F32, (n, n, 1, 2), a), filled(arena, F32, (k, n, 1, 2), b)
    out = arena.tensor(F32, (k, n, 1, 2), op=GgmlOp.SOLVE_TRI, src=(at, bt))
    execute([out])
    x = arena.get(out).astype(np.float64)
    np.testing.assert_allclose(np.tril(a.astype(np.float64)) @ x, b, rtol=1e-5, atol=1e-5)


def test_optimizer_steps_update_weights_and_moments_in_place(arena):
    w0, g = rand(1, 1, 2, 4), rand(1, 1, 2, 4, seed=1)
    m0, v0 = rand(1, 1, 2, 4, seed=2), np.abs(rand(1, 1, 2, 4, seed=3))
    w, gt = filled(arena, F32, (4, 2), w0), filled(arena, F32, (4, 2), g)
    m, v = filled(arena, F32, (4, 2), m0), filled(arena, F32, (4, 2), v0)
    hp = [0.01, 0.9, 0.999, 1e-8, 0.1, 1 / (1 - 0.9), 1 / (1 - 0.999)]
    pt = filled(arena, F32, (7,), np.array(hp, np.float32).reshape(1, 1, 1, 7))
    step = arena.view_of(w, (4, 2), w.nb, op=GgmlOp.OPT_STEP_ADAMW)
    step.src = [w, gt, m, v, pt, *([None] * 5)]
    step.flags = 16
    execute([step])
    alpha, b1, b2, eps, wd, b1h, b2h = hp
    m1 = m0 * b1 + g * (1 - b1)
    v1 = v0 * b2 + g * g * (1 - b2)
    w1 = w0 * (1 - alpha * wd) - alpha * (m1 * b1h) / (np.sqrt(v1 * b2h) + eps)
    np.testing.assert_allclose(arena.get(m), m1, rtol=1e-6)
    np.testing.assert_allclose(arena.get(v), v1, rtol=1e-6)
    np.testing.assert_allclose(arena.get(w), w1, rtol=1e-5, atol=1e-7)
    sp = filled(arena, F32, (2,), np.array([[[[0.5, 0.2]]]], np.float32))
    sgd = arena.view_of(w, (4, 2), w.nb, op=GgmlOp.OPT_STEP_SGD)
    sgd.src = [w, gt, sp, *([None] * 7)]
    sgd.flags = 16
    execute([sgd])
    np.testing.assert_allclose(arena.get(w), w1 * (1 - 0.5 * 0.2) - 0.5 * g, rtol=1e-5, atol=1e-7)
