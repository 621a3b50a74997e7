"""Linear-recurrence ops: RWKV_WKV6, GATED_LINEAR_ATTN, RWKV_WKV7, SSM_SCAN and GATED_DELTA_NET.

Each keeps a per-head state matrix that every token updates. Tokens are a true recurrence, so the kernels step
through a sequence's tokens one at a time, but each step is a few numpy calls over every sequence, head and state
element at once. The result packs the per-token outputs followed by the final state(s), as ggml lays them out.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import kernel, need_types, nelements, params_f32, params_i32, read, read_index, src
from .memory import F32, Memory, node_error


def _inputs(node: GraphTensor, mem: Memory, count: int) -> list[np.ndarray]:
    out = []
    for i in range(count):
        t = src(node, i)
        need_types(node, t, (F32,), f"source {i}")
        out.append(read(mem, t))
    return out


def _flat_result(node: GraphTensor, mem: Memory, size: int) -> np.ndarray:
    """The result's memory as one flat float32 view (the packed outputs-then-states layout needs it)."""
    if node.type != F32 or nelements(node) != size:
        raise node_error(node, f"result must be F32 with {size} elements")
    raw = mem.raw(node)
    if not raw.flags.c_contiguous:
        raise node_error(node, "result must be contiguous")
    return raw.reshape(-1)


def _rwkv_shapes(node: GraphTensor, n_vec: int) -> tuple[int, int, int, int]:
    """(head size S, heads H, tokens T, sequences n) from k [S, H, T] and state [S*S*H, n]."""
    k_t = src(node, 0)
    s_t = src(node, n_vec)
    size, heads, tokens = (int(v) for v in k_t.ne[:3])
    n_seqs = int(s_t.ne[1])
    if (k_t.ne[3] != 1 or n_seqs <= 0 or tokens % n_seqs or tuple(s_t.ne) != (size * size * heads, n_seqs, 1, 1)):
        raise node_error(node, "shapes must be [S, H, T] per token and state [S*S*H, n_seqs] with n_seqs | T")
    return size, heads, tokens, n_seqs


def _per_token(values: np.ndarray, n_seqs: int, size: int, heads: int) -> np.ndarray:
    """A [S, H, T] source as (n_seqs, tokens per sequence, H, S)."""
    return values.reshape(n_seqs, -1, heads, size)


def _wkv(node: GraphTensor, mem: Memory, n_vec: int, step) -> None:
    size, heads, tokens, n_seqs = _rwkv_shapes(node, n_vec)
    vecs = _inputs(node, mem, n_vec + 1)
    for i, t in enumerate(node.src[:n_vec]):
        if tuple(t.ne) not in ((size, heads, tokens, 1), (size, heads, 1, 1)):
            raise node_error(node, f"source {i} must be [S, H, T] (or [S, H] for time_first)")
    # time_first ([S, H]) is the same for every token; the rest are (n, T/n, H, S).
    per_tok = [v.reshape(1, heads, size) if v.size == size * heads else _per_token(v, n_seqs, size, heads)
               for v in vecs[:n_vec]]
    state = vecs[n_vec].reshape(n_seqs, heads, size, size).astype(np.float32, copy=True)
    out = _flat_result(node, mem, size * heads * (tokens + size * n_seqs))
    y = np.empty((n_seqs, tokens // n_seqs, heads, size), dtype=np.float32)
    for t in range(tokens // n_seqs):  # the recurrence: one vectorised step per token of every sequence
        state, y[:, t] = step(state, [p if p.ndim == 3 else p[:, t] for p in per_tok])
    out[: y.size] = y.reshape(-1)
    out[y.size :] = state.reshape(-1)


@kernel(GgmlOp.RWKV_WKV6, src=(F32,), dst=(F32,), note="k, v, r, time_first, time_decay, state [S*S*H, n_seqs]")
def _rwkv_wkv6(node: GraphTensor, mem: Memory) -> None:
    # State [i = key index][j = value index]: y_j = sum_i r_i (tf_i k_i v_j + S_ij); S <- td_i S_ij + k_i v_j.
    def step(s, vals):
        k, v, r, tf, td = vals
        kv = k[..., :, None] * v[..., None, :]
        y = np.einsum("nhi,nhij->nhj", r, tf[..., :, None] * kv + s, dtype=np.float32)
        return s * td[..., :, None] + kv, y

    _wkv(node, mem, 5, step)


@kernel(GgmlOp.GATED_LINEAR_ATTN, src=(F32,), dst=(F32,), note="k, v, q, gate, state; param scale")
def _gated_linear_attn(node: GraphTensor, mem: Memory) -> None:
    scale = np.float32(params_f32(node)[0])

    # S <- g_i S_ij + k_i v_j, then y_j = sum_i scale q_i S_ij.
    def step(s, vals):
        k, v, q, g = vals
        s = s * g[..., :, None] + k[..., :, None] * v[..., None, :]
        return s, np.einsum("nhi,nhij->nhj", q * scale, s, dtype=np.float32)

    _wkv(node, mem, 4, step)


@kernel(GgmlOp.RWKV_WKV7, src=(F32,), dst=(F32,), note="r, w, k, v, a, b, state [S*S*H, n_seqs]")
def _rwkv_wkv7(node: GraphTensor, mem: Memory) -> None:
    # State [i = value index][j = key index]: sa_i = sum_j a_j S_ij; S_ij <- S_ij w_j + v_i k_j + sa_i b_j;
    # y_i = sum_j S_ij r_j.
    def step(s, vals):
        r, w, k, v, a, b = vals
        sa = np.einsum("nhj,nhij->nhi", a, s, dtype=np.float32)
        s = s * w[..., None, :] + v[..., :, None] * k[..., None, :] + sa[..., :, None] * b[..., None, :]
        return s, np.einsum("nhij,nhj->nhi", s, r, dtype=np.float32)

    _wkv(node, mem, 6, step)


def _softplus(x: np.ndarray) -> np.ndarray:
    # ggml's softplus passes large arguments through unchanged (log1p(exp(x)) would overflow).
    return np.where(x <= np.float32(20), np.log1p(np.exp(np.minimum(x, np.float32(20)))), x).astype(np.float32)


@kernel(GgmlOp.SSM_SCAN, src=(F32,), dst=(F32,), note="Mamba-1 (A [N, H]) and Mamba-2 (A [1, H]); K state snapshots")
def _ssm_scan(node: GraphTensor, mem: Memory) -> None:
    s_t, x_t, dt_t, a_t, b_t, c_t = (src(node, i) for i in range(6))
    ids_t = src(node, 6)
    d_state, head_dim, n_head, n_rs = (int(v) for v in s_t.ne)
    _, _, n_tok, n_seqs = (int(v) for v in x_t.ne)
    n_group = int(b_t.ne[1])
    snaps = int(params_i32(node)[0])
    if (tuple(x_t.ne[:2]) != (head_dim, n_head) or tuple(dt_t.ne) != (n_head, n_tok, n_seqs, 1)
            or tuple(a_t.ne) not in ((1, n_head, 1, 1), (d_state, n_head, 1, 1)) or n_group <= 0
            or n_head % n_group or tuple(b_t.ne) != (d_state, n_group, n_tok, n_seqs) or tuple(c_t.ne) != tuple(b_t.ne)
            or tuple(ids_t.ne) != (n_seqs, 1, 1, 1) or snaps < 1):
        raise node_error(node, "shapes must be s [N, D, H, rs], x [D, H, T, n], dt [H, T, n], A [1|N, H], "
                               "B and C [N, G, T, n], ids [n], K >= 1")
    s, x, dt, a, b, c = _inputs(node, mem, 6)
    ids = read_index(mem, node, ids_t, n_rs, "state ids")[0, 0, 0]
    states = n_seqs * n_head * head_dim * d_state
    out = _flat_result(node, mem, n_seqs * n_tok * n_head * head_dim + snaps * states)
    state = s[ids].astype(np.float32, copy=True)  # (n, H, D, N): sequence i starts from state ids[i]
    dt_sp = _softplus(dt[0])  # (n, T, H)
    a = a[0, 0]  # (H, 1|N)
    # Head h reads the B and C of group h // (H / G): consecutive heads share a group (measured against ggml's CPU
    # backend: h mod G fails every case with more than one group and more heads than groups).
    group = np.arange(n_head) // (n_head // n_group)
    y = np.empty((n_seqs, n_tok, n_head, head_dim), dtype=np.float32)
    snap_view = out[y.size :].reshape(snaps, n_seqs, n_head, head_dim, d_state)
    for t in range(n_tok):  # the recurrence, one vectorised step per token
        da = np.exp(dt_sp[:, t, :, None] * a[None])  # (n, H, 1|N)
        bx = b[:, t][:, group][:, :, None, :] * (x[:, t] * dt_sp[:, t, :, None])[..., None]
        state = state * da[:, :, None, :] + bx
        y[:, t] = np.einsum("nhdk,nhk->nhd", state, c[:, t][:, group], dtype=np.float32)
        back = n_tok - 1 - t  # snapshot slot s holds the state s tokens before the last
        if back < snaps:
            snap_view[back] = state
    out[: y.size] = y.reshape(-1)


@kernel(GgmlOp.GATED_DELTA_NET, src=(F32,), dst=(F32,), note="q, k, v, gate (per head or key), beta, state, K")
def _gated_delta_net(node: GraphTensor, mem: Memory) -> None:
    q_t, k_t, v_t, g_t, beta_t, s_t = (src(node, i) for i in range(6))
    s_k, h_k, n_tok, n_seqs = (int(v) for v in q_t.ne)
    s_v, h_v = int(v_t.ne[0]), int(v_t.ne[1])
    snaps = int(params_i32(node)[0])
    if (tuple(k_t.ne) != tuple(q_t.ne) or s_k != s_v or h_k <= 0 or h_v % h_k or tuple(v_t.ne[2:]) != (n_tok, n_seqs)
            or tuple(g_t.ne) not in ((1, h_v, n_tok, n_seqs), (s_v, h_v, n_tok, n_seqs))
            or tuple(beta_t.ne) != (1, h_v, n_tok, n_seqs) or tuple(s_t.ne) != (s_v, s_v, h_v, n_seqs) or snaps < 1):
        raise node_error(node, "shapes must be q, k [S, Hk, T, n], v [S, Hv, T, n], g [1|S, Hv, T, n], "
                               "beta [1, Hv, T, n], state [S, S, Hv, n], K >= 1")
    q, k, v, g, beta, s = _inputs(node, mem, 6)
    heads = np.arange(h_v) % h_k  # value head h reads query/key head h mod Hk
    q, k = q[:, :, heads], k[:, :, heads]  # (n, T, Hv, S)
    scale = np.float32(1.0 / np.sqrt(s_k))
    state = s.astype(np.float32, copy=True)  # (n, Hv, i = value index, j = key index)
    out = _flat_result(node, mem, n_seqs * n_tok * h_v * s_v + snaps * n_seqs * h_v * s_v * s_v)
    y = np.empty((n_seqs, n_tok, h_v, s_v), dtype=np.float32)
    snap_view = out[y.size :].reshape(snaps, n_seqs, h_v, s_v, s_v)
    decay = np.exp(g)  # (n, T, Hv, 1|S): per head, or per key index (KDA)
    for t in range(n_tok):  # the delta rule, one vectorised step per token
        state = state * decay[:, t, :, None, :]
        kt = k[:, t]
        delta = (v[:, t] - np.einsum("nhij,nhj->nhi", state, kt, dtype=np.float32)) * beta[:, t]
        state = state + delta[..., :, None] * kt[..., None, :]
        y[:, t] = np.einsum("nhij,nhj->nhi", state, q[:, t] * scale, dtype=np.float32)
        back = n_tok - 1 - t
        if back < snaps:
            snap_view[back] = state
    out[: y.size] = y.reshape(-1)
