"""Backward-pass and training ops a client may send: SILU_BACK, RMS_NORM_BACK, SOFT_MAX_BACK, REPEAT_BACK,
GET_ROWS_BACK, CROSS_ENTROPY_LOSS(_BACK), COUNT_EQUAL, plus SSM_CONV and COL2IM_1D.

Source order follows ggml's CPU kernels (the gradient first where ggml puts it first), the formulas the
derivatives of the forward ops; everything in float32 over whole rows at once.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, nelements, params_f32, params_i32, read, read_index, src, write
from .memory import F32, I32, I64, Memory, node_error, shape4

F = np.float32


def _same(node: GraphTensor, *ts: GraphTensor) -> None:
    for t in ts:
        if tuple(t.ne) != tuple(node.ne):
            raise node_error(node, "sources must have the result's shape")


@kernel(GgmlOp.SILU_BACK, src=FLOATS, dst=FLOATS, note="src0 dy, src1 x")
def _silu_back(node: GraphTensor, mem: Memory) -> None:
    dy_t, x_t = src(node, 0), src(node, 1)
    _same(node, dy_t, x_t)
    x, dy = read(mem, x_t), read(mem, dy_t)
    s = F(1) / (F(1) + np.exp(-x))
    write(mem, node, dy * s * (F(1) + x * (F(1) - s)))


@kernel(GgmlOp.RMS_NORM_BACK, src=(F32,), dst=(F32,), note="src0 dy, src1 x; eps from op_params")
def _rms_norm_back(node: GraphTensor, mem: Memory) -> None:
    dy_t, x_t = src(node, 0), src(node, 1)
    _same(node, dy_t, x_t)
    eps = F(params_f32(node)[0])
    x, dy = read(mem, x_t).astype(np.float64), read(mem, dy_t).astype(np.float64)
    n = x.shape[-1]
    mean = (x * x).sum(-1, keepdims=True) / n
    rrms = 1.0 / np.sqrt(mean + eps)
    sum_xdy = (x * dy).sum(-1, keepdims=True)
    # d/dx of x / rms(x): dy / rms - x * <x, dy> / (n * rms^3)
    write(mem, node, (dy * rrms - x * sum_xdy * rrms**3 / n).astype(F))


@kernel(GgmlOp.SOFT_MAX_BACK, src=(F32,), dst=(F32,), note="src0 dy, src1 the softmax output; scale")
def _soft_max_back(node: GraphTensor, mem: Memory) -> None:
    dy_t, y_t = src(node, 0), src(node, 1)
    _same(node, dy_t, y_t)
    scale, max_bias = (F(v) for v in params_f32(node)[:2])
    if max_bias != 0:
        raise node_error(node, "SOFT_MAX_BACK with ALiBi (max_bias != 0) is not defined by ggml's CPU backend")
    y, dy = read(mem, y_t).astype(np.float64), read(mem, dy_t).astype(np.float64)
    dot = (y * dy).sum(-1, keepdims=True)
    write(mem, node, (scale * y * (dy - dot)).astype(F))


@kernel(GgmlOp.REPEAT_BACK, src=FLOATS, dst=FLOATS, note="sums the repetitions of source 0")
def _repeat_back(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    if any(d <= 0 or a % d for a, d in zip(a_t.ne, node.ne, strict=True)):
        raise node_error(node, "source dims must be whole multiples of the result's")
    n = shape4(node)
    reps = tuple(a // d for a, d in zip(shape4(a_t), n, strict=True))
    # REPEAT laid the copies end to end per dim: index k * n + j; reshape each dim to (k, n) and sum the k axes.
    x = read(mem, a_t).astype(np.float64).reshape(reps[0], n[0], reps[1], n[1], reps[2], n[2], reps[3], n[3])
    write(mem, node, x.sum(axis=(0, 2, 4, 6)).astype(F))


@kernel(GgmlOp.GET_ROWS_BACK, src=(F32,), dst=(F32,), note="adds gradient rows into their source rows")
def _get_rows_back(node: GraphTensor, mem: Memory) -> None:
    g_t, i_t = src(node, 0), src(node, 1)
    n_idx = nelements(i_t)
    # ggml reads one gradient row per index, in order: gradient rows past the last index are not read.
    if g_t.ne[0] != node.ne[0] or nelements(g_t) < int(g_t.ne[0]) * n_idx:
        raise node_error(node, "gradient must hold one [n_embd] row per index")
    if node.ne[2] != 1 or node.ne[3] != 1:
        raise node_error(node, "result must be 2-D [n_embd, rows]")
    idx = read_index(mem, node, i_t, int(node.ne[1]), "row index").reshape(-1)
    out = np.zeros((int(node.ne[1]), int(node.ne[0])), dtype=F)
    np.add.at(out, idx, read(mem, g_t).reshape(-1, int(node.ne[0]))[:n_idx])
    write(mem, node, out[None, None])


@kernel(GgmlOp.COUNT_EQUAL, src=(I32,), dst=(I64,), note="number of equal elements, as I64")
def _count_equal(node: GraphTensor, mem: Memory) -> None:
    a_t, b_t = src(node, 0), src(node, 1)
    if a_t.type != I32 or b_t.type != I32 or tuple(a_t.ne) != tuple(b_t.ne) or node.type != I64:
        raise node_error(node, "sources must be I32 of one shape and the result I64")
    mem.raw(node)[...] = np.int64(np.count_nonzero(mem.raw(a_t) == mem.raw(b_t)))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@kernel(GgmlOp.CROSS_ENTROPY_LOSS, src=(F32,), dst=(F32,), note="mean over rows of -sum(labels * log softmax)")
def _cross_entropy_loss(node: GraphTensor, mem: Memory) -> None:
    a_t, b_t = src(node, 0), src(node, 1)
    if tuple(a_t.ne) != tuple(b_t.ne) or nelements(node) != 1:
        raise node_error(node, "logits and labels must share a shape and the result be a scalar")
    logits = read(mem, a_t).astype(np.float64).reshape(-1, int(a_t.ne[0]))
    labels = read(mem, b_t).astype(np.float64).reshape(logits.shape)
    write(mem, node, F(-(labels * _log_softmax(logits)).sum() / logits.shape[0]))


@kernel(GgmlOp.CROSS_ENTROPY_LOSS_BACK, src=(F32,), dst=(F32,), note="src0 the loss gradient, src1 logits, src2 labels")
def _cross_entropy_loss_back(node: GraphTensor, mem: Memory) -> None:
    g_t, a_t, b_t = src(node, 0), src(node, 1), src(node, 2)
    if nelements(g_t) != 1 or tuple(a_t.ne) != tuple(b_t.ne) or tuple(node.ne) != tuple(a_t.ne):
        raise node_error(node, "gradient must be a scalar, logits, labels and result of one shape")
    logits = read(mem, a_t).astype(np.float64)
    labels = read(mem, b_t).astype(np.float64)
    nr = nelements(a_t) // int(a_t.ne[0])
    grad = float(read(mem, g_t).reshape(-1)[0])
    write(mem, node, ((np.exp(_log_softmax(logits)) - labels) * grad / nr).astype(F))


@kernel(GgmlOp.SSM_CONV, src=(F32,), dst=(F32,), note="sx [d_conv - 1 + n_t, d_inner, n_s], c [d_conv, d_inner]")
def _ssm_conv(node: GraphTensor, mem: Memory) -> None:
    sx_t, c_t = src(node, 0), src(node, 1)
    d_conv, d_inner = int(c_t.ne[0]), int(c_t.ne[1])
    n_t = int(sx_t.ne[0]) - d_conv + 1
    n_s = int(sx_t.ne[2])
    if sx_t.ne[1] != d_inner or n_t <= 0 or tuple(node.ne[:3]) != (d_inner, n_t, n_s):
        raise node_error(node, "shapes do not fit SSM_CONV (result [d_inner, n_t, n_s])")
    sx = read(mem, sx_t)[0]  # (n_s, d_inner, d_conv - 1 + n_t)
    c = read(mem, c_t)[0, 0]  # (d_inner, d_conv)
    win = sx[:, :, np.arange(n_t)[:, None] + np.arange(d_conv)[None, :]]  # (n_s, d_inner, n_t, d_conv)
    out = np.einsum("sitk,ik->sti", win, c, dtype=F)
    write(mem, node, out[None])


@kernel(GgmlOp.COL2IM_1D, src=(F32,), dst=(F32,), note="columns [K*OC, T_in] scattered into [T_out, OC]")
def _col2im_1d(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    s0, oc, p0 = (int(v) for v in params_i32(node)[:3])
    kc, t_in = int(a_t.ne[0]), int(a_t.ne[1])
    if s0 <= 0 or oc <= 0 or kc % oc or p0 < 0:
        raise node_error(node, "stride and channels must be positive, columns a multiple of the channels")
    k = kc // oc
    t_out = (t_in - 1) * s0 + k - 2 * p0
    if t_out <= 0 or tuple(node.ne[:2]) != (t_out, oc) or a_t.ne[2] != node.ne[2] or a_t.ne[3] != node.ne[3]:
        raise node_error(node, f"result must be [{t_out}, {oc}, ...]")
    cols = read(mem, a_t)  # (b, a, T_in, K*OC): column t holds tap k of channel o at k + K * o
    cols = cols.reshape(*cols.shape[:2], t_in, oc, k)
    full = np.zeros((*cols.shape[:2], oc, (t_in - 1) * s0 + k), dtype=F)
    at = (np.arange(t_in)[:, None] * s0 + np.arange(k)[None, :]).reshape(-1)  # (T_in * K,)
    np.add.at(full, (slice(None), slice(None), slice(None), at), cols.transpose(0, 1, 3, 2, 4).reshape(
        *cols.shape[:2], oc, -1))
    write(mem, node, full[..., p0 : p0 + t_out])


@kernel(GgmlOp.SOLVE_TRI, src=(F32,), dst=(F32,), note="A X = B, A lower triangular; batched over dims 2/3")
def _solve_tri(node: GraphTensor, mem: Memory) -> None:
    # ggml builds only the lower, left-hand, non-unit-diagonal variant (ggml_solve_tri asserts it), so there
    # is nothing to read from op_params: A [n, n] (rows in dim 1), B and X [k, n]; A's upper triangle is unread.
    a_t, b_t = src(node, 0), src(node, 1)
    n = int(a_t.ne[0])
    if a_t.ne[1] != n or b_t.ne[1] != n or tuple(node.ne) != tuple(b_t.ne) or tuple(a_t.ne[2:]) != tuple(b_t.ne[2:]):
        raise node_error(node, "A must be [n, n, ...], B and the result [k, n, ...] with the same batch dims")
    # Forward substitution in float32, row by row (each row vectorised over columns and batches): random
    # triangular systems are ill-conditioned, and a float64 solve lands far from ggml's float32 one.
    a = read(mem, a_t).astype(F)
    b = read(mem, b_t).astype(F)
    x = np.empty_like(b)
    for i in range(n):
        terms = a[..., i, :i, None] * x[..., :i, :]
        acc = np.cumsum(terms, axis=-2, dtype=F)[..., -1, :] if i else np.zeros_like(b[..., 0, :])
        x[..., i, :] = (b[..., i, :] - acc) / a[..., i, i, None]
    write(mem, node, x)


def _opt_inputs(node: GraphTensor, mem: Memory, n_src: int, n_params: int) -> list[np.ndarray]:
    ts = [src(node, i) for i in range(n_src)]
    for t in ts[:-1]:
        if t.type != F32 or tuple(t.ne) != tuple(ts[0].ne):
            raise node_error(node, "weights, gradient and moments must be F32 of one shape")
    if ts[-1].type != F32 or nelements(ts[-1]) < n_params:
        raise node_error(node, f"optimizer parameters must be F32 with {n_params} values")
    if tuple(node.ne) != tuple(ts[0].ne):
        raise node_error(node, "result must have the weights' shape")
    return [mem.raw(t) for t in ts[:-1]] + [read(mem, ts[-1]).reshape(-1)]


@kernel(GgmlOp.OPT_STEP_SGD, src=(F32,), dst=(F32,), note="w -= alpha * (g + wd * w); params [alpha, wd]")
def _opt_step_sgd(node: GraphTensor, mem: Memory) -> None:
    w, g, p = _opt_inputs(node, mem, 3, 2)
    alpha, wd = F(p[0]), F(p[1])
    # ggml's result is a view of the weights, updated in place; a result elsewhere gets a copy as well.
    np.copyto(w, w * (F(1) - alpha * wd) - alpha * g)
    out = mem.raw(node)
    if not np.shares_memory(out, w):
        np.copyto(out, w)


@kernel(GgmlOp.OPT_STEP_ADAMW, src=(F32,), dst=(F32,),
        note="params [alpha, beta1, beta2, eps, wd, beta1h, beta2h]; w, m, v updated in place")
def _opt_step_adamw(node: GraphTensor, mem: Memory) -> None:
    w, g, m, v, p = _opt_inputs(node, mem, 5, 7)
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = (F(x) for x in p[:7])
    np.copyto(m, m * beta1 + g * (F(1) - beta1))
    np.copyto(v, v * beta2 + g * g * (F(1) - beta2))
    mh = m * beta1h
    vh = np.sqrt(v * beta2h) + eps
    np.copyto(w, w * (F(1) - alpha * wd) - alpha * mh / vh)
    out = mem.raw(node)
    if not np.shares_memory(out, w):
        np.copyto(out, w)
