"""Image ops: IM2COL (1-D and 2-D), CONV_2D, POOL_2D and UPSCALE (nearest, bilinear)."""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_i32, read, src, write
from .memory import F16, F32, Memory, node_error, shape4


def _out_size(size: int, kernel_size: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (kernel_size - 1) - 1) // stride + 1


def _columns(x: np.ndarray, kw: int, kh: int, s: tuple[int, int], p: tuple[int, int], d: tuple[int, int],
             ow: int, oh: int) -> np.ndarray:
    """x (N, C, H, W) -> columns (N, OH, OW, C, KH, KW), zero outside the input."""
    h, w = x.shape[2], x.shape[3]
    iy = np.arange(oh)[:, None] * s[1] + np.arange(kh)[None, :] * d[1] - p[1]  # (OH, KH)
    ix = np.arange(ow)[:, None] * s[0] + np.arange(kw)[None, :] * d[0] - p[0]  # (OW, KW)
    vy = (iy >= 0) & (iy < h)
    vx = (ix >= 0) & (ix < w)
    g = x[:, :, np.clip(iy, 0, max(h - 1, 0))[:, :, None, None], np.clip(ix, 0, max(w - 1, 0))[None, None, :, :]]
    # g: (N, C, OH, KH, OW, KW)
    g = g * (vy[:, :, None, None] & vx[None, None, :, :])
    return g.transpose(0, 2, 4, 1, 3, 5)


def _conv_params(node: GraphTensor) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    s0, s1, p0, p1, d0, d1 = (int(v) for v in params_i32(node)[:6])
    if s0 <= 0 or s1 <= 0 or d0 <= 0 or d1 <= 0 or p0 < 0 or p1 < 0:
        raise node_error(node, "strides and dilations must be positive, paddings non-negative")
    return (s0, s1), (p0, p1), (d0, d1)


@kernel(GgmlOp.IM2COL, src=FLOATS, dst=(F32, F16))
def _im2col(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, x_t, FLOATS, "input")
    s, p, d = _conv_params(node)
    is_2d = int(params_i32(node)[6]) != 0
    if is_2d:
        kw, kh, c = int(k_t.ne[0]), int(k_t.ne[1]), int(k_t.ne[2])
        w, h, c1, n = (int(v) for v in x_t.ne)
        x = read(mem, x_t)  # (N, C, H, W)
    else:
        kw, kh, c = int(k_t.ne[0]), 1, int(k_t.ne[1])
        w, c1, n = int(x_t.ne[0]), int(x_t.ne[1]), int(x_t.ne[2])
        h = 1
        x = read(mem, x_t)[0][:, :, None, :]  # (N, C, 1, W)
    ow, oh = _out_size(w, kw, s[0], p[0], d[0]), _out_size(h, kh, s[1], p[1], d[1]) if is_2d else 1
    want = (c * kh * kw, ow, oh, n) if is_2d else (c * kw, ow, n, 1)
    if c != c1 or ow <= 0 or oh <= 0 or tuple(node.ne) != want:
        raise node_error(node, f"result must be {list(want)} for this kernel and input")
    cols = _columns(x, kw, kh, s, (p[0], p[1] if is_2d else 0), d, ow, oh)  # (N, OH, OW, C, KH, KW)
    write(mem, node, cols.reshape(shape4(node)))


@kernel(GgmlOp.CONV_2D, src=FLOATS, dst=(F32,))
def _conv_2d(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, k_t, FLOATS, "kernel")
    need_types(node, x_t, FLOATS, "input")
    s, p, d = _conv_params(node)
    kw, kh, c, oc = (int(v) for v in k_t.ne)
    w, h, c1, n = (int(v) for v in x_t.ne)
    ow, oh = _out_size(w, kw, s[0], p[0], d[0]), _out_size(h, kh, s[1], p[1], d[1])
    if c != c1 or ow <= 0 or oh <= 0 or tuple(node.ne) != (ow, oh, oc, n):
        raise node_error(node, f"result must be [{ow}, {oh}, {oc}, {n}] for this kernel and input")
    cols = _columns(read(mem, x_t), kw, kh, s, p, d, ow, oh).reshape(n, oh * ow, c * kh * kw)
    kernel_mat = read(mem, k_t).reshape(oc, c * kh * kw)  # (OC, C*KH*KW)
    out = np.matmul(cols, kernel_mat.T)  # (N, OH*OW, OC)
    write(mem, node, out.transpose(0, 2, 1).reshape(n, oc, oh, ow))


@kernel(GgmlOp.POOL_2D, src=(F32,), dst=(F32,), note="MAX and AVG (average over the whole window)")
def _pool_2d(node: GraphTensor, mem: Memory) -> None:
    x_t = src(node, 0)
    need_types(node, x_t, (F32,), "input")
    op, k0, k1, s0, s1, p0, p1 = (int(v) for v in params_i32(node)[:7])
    w, h, c, n = (int(v) for v in x_t.ne)
    if op not in (0, 1) or min(k0, k1, s0, s1) <= 0 or p0 < 0 or p1 < 0:
        raise node_error(node, "pool op must be MAX (0) or AVG (1) with positive kernel and stride")
    ow, oh = (w + 2 * p0 - k0) // s0 + 1, (h + 2 * p1 - k1) // s1 + 1
    if ow <= 0 or oh <= 0 or tuple(node.ne) != (ow, oh, c, n):
        raise node_error(node, f"result must be [{ow}, {oh}, {c}, {n}]")
    x = read(mem, x_t)  # (N, C, H, W)
    fill = np.float32(-np.finfo(np.float32).max) if op == 0 else np.float32(0)
    padded = np.full((n, c, h + 2 * p1 + k1, w + 2 * p0 + k0), fill, dtype=np.float32)
    padded[:, :, p1 : p1 + h, p0 : p0 + w] = x
    iy = (np.arange(oh) * s1)[:, None] + np.arange(k1)[None, :]
    ix = (np.arange(ow) * s0)[:, None] + np.arange(k0)[None, :]
    win = padded[:, :, iy[:, :, None, None], ix[None, None, :, :]]  # (N, C, OH, K1, OW, K0)
    out = win.max(axis=(3, 5)) if op == 0 else win.sum(axis=(3, 5)) / np.float32(k0 * k1)
    write(mem, node, out)


@kernel(GgmlOp.UPSCALE, src=FLOATS, dst=(F32,), note="nearest (all dims), bilinear (dims 0, 1)")
def _upscale(node: GraphTensor, mem: Memory) -> None:
    x_t = src(node, 0)
    need_types(node, x_t, FLOATS, "input")
    flags = int(params_i32(node)[0])
    mode, align_corners = flags & 0xFF, bool(flags & (1 << 8))
    x = read(mem, x_t)
    src_shape, dst_shape = shape4(x_t), shape4(node)
    if min(src_shape) <= 0:
        raise node_error(node, "empty input")
    if mode == 0:
        idx = [np.minimum((np.arange(o) * (s / o)).astype(np.int64), s - 1) for s, o in zip(src_shape, dst_shape,
                                                                                           strict=True)]
        write(mem, node, x[np.ix_(*idx)])
        return
    if mode != 1:
        raise node_error(node, f"upscale mode {mode} is not supported (nearest 0, bilinear 1)")
    if src_shape[:2] != dst_shape[:2]:
        raise node_error(node, "bilinear upscale changes dims 0 and 1 only")
    out = x
    for axis in (2, 3):
        n_in, n_out = src_shape[axis], dst_shape[axis]
        if align_corners and n_out > 1:
            pos = np.arange(n_out, dtype=np.float32) * np.float32((n_in - 1) / (n_out - 1))
        else:
            sf = np.float32(n_out / n_in)
            pos = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) / sf - np.float32(0.5)
        i0 = np.floor(pos).astype(np.int64)
        frac = (pos - i0).astype(np.float32)
        lo = np.clip(i0, 0, n_in - 1)
        hi = np.clip(i0 + 1, 0, n_in - 1)
        shape = [1, 1, 1, 1]
        shape[axis] = n_out
        frac = frac.reshape(shape)
        out = np.take(out, lo, axis=axis) * (1 - frac) + np.take(out, hi, axis=axis) * frac
    write(mem, node, out)
