"""RWKV_WKV6, GATED_LINEAR_ATTN, RWKV_WKV7, SSM_SCAN and GATED_DELTA_NET against scalar-loop formulations of the
recurrences (float64, element by element), on small cases with non-contiguous (permuted) per-token sources."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_ops import filled, permuted, rand

F32, I32 = int(GgmlType.F32), int(GgmlType.I32)
S, H, NS, NT = 3, 2, 2, 3  # head size, heads, sequences, tokens per sequence
T = NS * NT


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 20)


def tok(seed: int, lo: float | None = None) -> np.ndarray:
    """A per-token [S, H, T] source as (1, T, H, S); with ``lo``, values in (lo, 1) (decays)."""
    x = rand(1, T, H, S, seed=seed)
    return (lo + (1 - lo) / (1 + np.exp(-x))).astype(np.float32) if lo is not None else x


def run_wkv(arena, op, vecs, state, extra=()):
    srcs = [permuted(arena, v) if v.shape[1] == T else filled(arena, F32, (S, H), v) for v in vecs]
    st = filled(arena, F32, (S * S * H, NS), state.reshape(1, 1, NS, S * S * H))
    out = arena.tensor(F32, (S * H, T + S * NS), op=op, src=(*srcs, st), params=params(*extra))
    execute([out])
    flat = arena.get(out).reshape(-1)
    return flat[: T * H * S].reshape(T, H, S), flat[T * H * S :].reshape(NS, H, S, S)


def test_rwkv_wkv6(arena):
    k, v, r, td = tok(0), tok(1), tok(2), tok(3, lo=0.5)
    tf = rand(1, 1, H, S, seed=4)
    s0 = rand(NS, H, S, S, seed=5)
    y, s_end = run_wkv(arena, GgmlOp.RWKV_WKV6, [k, v, r, tf, td], s0)
    want_y = np.zeros((T, H, S))
    st = s0.astype(np.float64).copy()
    for t in range(T):
        n = t // NT
        for h in range(H):
            for i in range(S):
                for j in range(S):
                    kv = k[0, t, h, i] * v[0, t, h, j]
                    want_y[t, h, j] += r[0, t, h, i] * (tf[0, 0, h, i] * kv + st[n, h, i, j])
                    st[n, h, i, j] = st[n, h, i, j] * td[0, t, h, i] + kv
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_end, st, rtol=1e-4, atol=1e-5)


def test_gated_linear_attn(arena):
    k, v, q, g = tok(0), tok(1), tok(2), tok(3, lo=0.5)
    s0 = rand(NS, H, S, S, seed=5)
    scale = 0.25
    y, s_end = run_wkv(arena, GgmlOp.GATED_LINEAR_ATTN, [k, v, q, g], s0, extra=(scale,))
    want_y = np.zeros((T, H, S))
    st = s0.astype(np.float64).copy()
    for t in range(T):
        n = t // NT
        for h in range(H):
            for i in range(S):
                for j in range(S):
                    st[n, h, i, j] = st[n, h, i, j] * g[0, t, h, i] + k[0, t, h, i] * v[0, t, h, j]
                    want_y[t, h, j] += scale * q[0, t, h, i] * st[n, h, i, j]
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_end, st, rtol=1e-4, atol=1e-5)


def test_rwkv_wkv7(arena):
    r, w, k, v, a, b = tok(0), tok(1, lo=0.5), tok(2), tok(3), tok(4), tok(5)
    s0 = rand(NS, H, S, S, seed=6)
    y, s_end = run_wkv(arena, GgmlOp.RWKV_WKV7, [r, w, k, v, a, b], s0)
    want_y = np.zeros((T, H, S))
    st = s0.astype(np.float64).copy()
    for t in range(T):
        n = t // NT
        for h in range(H):
            for i in range(S):  # value index
                sa = sum(a[0, t, h, j] * st[n, h, i, j] for j in range(S))
                for j in range(S):
                    st[n, h, i, j] = (st[n, h, i, j] * w[0, t, h, j] + v[0, t, h, i] * k[0, t, h, j]
                                      + sa * b[0, t, h, j])
                    want_y[t, h, i] += st[n, h, i, j] * r[0, t, h, j]
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_end, st, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mamba2", [False, True])
def test_ssm_scan_with_state_ids_and_snapshots(arena, mamba2):
    N, D, G, K = 3, 2, 2, 2 if mamba2 else 1  # d_state, head_dim, groups, snapshots
    n_rs = 3
    s = rand(n_rs, H, D, N, seed=0)
    x, dt = rand(NS, NT, H, D, seed=1), rand(1, NS, NT, H, seed=2)
    dt[0, 0, 0, 0] = 25.0  # above softplus's pass-through threshold
    a = -np.abs(rand(1, 1, H, 1 if mamba2 else N, seed=3))
    groups = G if mamba2 else 1
    b, c = rand(NS, NT, groups, N, seed=4), rand(NS, NT, groups, N, seed=5)
    ids = np.array([2, 0], dtype=np.int32)
    srcs = (filled(arena, F32, (N, D, H, n_rs), s), permuted(arena, x), filled(arena, F32, (H, NT, NS), dt),
            filled(arena, F32, (a.shape[3], H), a), permuted(arena, b), permuted(arena, c),
            filled(arena, I32, (NS,), ids.reshape(1, 1, 1, NS)))
    y_size, st_size = NS * NT * H * D, NS * H * D * N
    out = arena.tensor(F32, (y_size + K * st_size,), op=GgmlOp.SSM_SCAN, src=srcs, params=params(K))
    execute([out])
    flat = arena.get(out).reshape(-1)
    want_y = np.zeros((NS, NT, H, D))
    snaps = np.zeros((K, NS, H, D, N))
    for n in range(NS):
        st = s[ids[n]].astype(np.float64).copy()
        for t in range(NT):
            for h in range(H):
                d_raw = float(dt[0, n, t, h])
                dsp = d_raw if d_raw > 20 else np.log1p(np.exp(d_raw))
                g = h // (H // groups)
                for d in range(D):
                    for m in range(N):
                        decay = np.exp(dsp * a[0, 0, h, 0 if mamba2 else m])
                        st[h, d, m] = st[h, d, m] * decay + b[n, t, g, m] * x[n, t, h, d] * dsp
                        want_y[n, t, h, d] += st[h, d, m] * c[n, t, g, m]
            if NT - 1 - t < K:
                snaps[NT - 1 - t, n] = st
    np.testing.assert_allclose(flat[:y_size].reshape(want_y.shape), want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(flat[y_size:].reshape(snaps.shape), snaps, rtol=1e-4, atol=1e-5)


def test_ssm_scan_refuses_state_ids_out_of_range(arena):
    N, D = 2, 1
    srcs = (filled(arena, F32, (N, D, H, 1), rand(1, H, D, N)), filled(arena, F32, (D, H, 1, 1), rand(1, 1, H, D)),
            filled(arena, F32, (H, 1, 1), rand(1, 1, 1, H)), filled(arena, F32, (1, H), rand(1, 1, H, 1)),
            filled(arena, F32, (N, 1, 1, 1), rand(1, 1, 1, N)), filled(arena, F32, (N, 1, 1, 1), rand(1, 1, 1, N)),
            filled(arena, I32, (1,), np.array([[[[5]]]], dtype=np.int32)))
    out = arena.tensor(F32, (D * H + N * D * H,), op=GgmlOp.SSM_SCAN, src=srcs, params=params(1))
    with pytest.raises(Exception, match="state ids value 5"):
        execute([out])


@pytest.mark.parametrize("kda", [False, True])
def test_gated_delta_net_with_repeated_value_heads(arena, kda):
    hk, rep, K = 1, 2, 2
    hv = hk * rep
    q, k = rand(NS, NT, hk, S, seed=0), rand(NS, NT, hk, S, seed=1)
    v = rand(NS, NT, hv, S, seed=2)
    g = -np.abs(rand(NS, NT, hv, S if kda else 1, seed=3))
    beta = 1 / (1 + np.exp(-rand(NS, NT, hv, 1, seed=4)))
    s0 = rand(NS, hv, S, S, seed=5)
    srcs = (permuted(arena, q), permuted(arena, k), permuted(arena, v), filled(arena, F32, (g.shape[3], hv, NT, NS), g),
            filled(arena, F32, (1, hv, NT, NS), beta.astype(np.float32)), filled(arena, F32, (S, S, hv, NS), s0))
    y_size, st_size = NS * NT * hv * S, NS * hv * S * S
    out = arena.tensor(F32, (S * hv, NS * NT + K * S * NS), op=GgmlOp.GATED_DELTA_NET, src=srcs, params=params(K))
    execute([out])
    flat = arena.get(out).reshape(-1)
    want_y = np.zeros((NS, NT, hv, S))
    snaps = np.zeros((K, NS, hv, S, S))
    for n in range(NS):
        for h in range(hv):
            st = s0[n, h].astype(np.float64).copy()  # [value index i][key index j]
            for t in range(NT):
                kk, qq = k[n, t, h % hk], q[n, t, h % hk] / np.sqrt(S)
                for i in range(S):
                    for j in range(S):
                        st[i, j] *= np.exp(g[n, t, h, j if kda else 0])
                for i in range(S):
                    delta = (v[n, t, h, i] - sum(st[i, j] * kk[j] for j in range(S))) * beta[n, t, h, 0]
                    for j in range(S):
                        st[i, j] += delta * kk[j]
                for i in range(S):
                    want_y[n, t, h, i] = sum(st[i, j] * qq[j] for j in range(S))
                if NT - 1 - t < K:
                    snaps[NT - 1 - t, n, h] = st
    np.testing.assert_allclose(flat[:y_size].reshape(want_y.shape), want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(flat[y_size:].reshape(snaps.shape), snaps, rtol=1e-4, atol=1e-5)
    assert st_size * K == flat.size - y_size
