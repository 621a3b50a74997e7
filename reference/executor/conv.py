"""Image ops: IM2COL (1-D and 2-D), CONV_2D, POOL_2D and UPSCALE (nearest, bilinear)."""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_i32, read, src, write
from .memory import F16, F32, Memory, node_error, shape4
from .types import through_type


def _cdiv(a: int, b: int) -> int:
    """C integer division (truncates toward zero): a window that overhangs the padded input still yields one
    output in ggml, where Python's floor division would yield none."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _out_size(size: int, kernel_size: int, stride: int, pad: int, dilation: int) -> int:
    return _cdiv(size + 2 * pad - dilation * (kernel_size - 1) - 1, stride) + 1


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


def _conv_params(node: GraphTensor, is_2d: bool = True) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    s0, s1, p0, p1, d0, d1 = (int(v) for v in params_i32(node)[:6])
    if not is_2d:
        # A 1-D op leaves the second axis' stride, padding and dilation at 0; ggml never reads them.
        s1, p1, d1 = 1, 0, 1
    if s0 <= 0 or s1 <= 0 or d0 <= 0 or d1 <= 0 or p0 < 0 or p1 < 0:
        raise node_error(node, "strides and dilations must be positive, paddings non-negative")
    return (s0, s1), (p0, p1), (d0, d1)


@kernel(GgmlOp.IM2COL, src=FLOATS, dst=(F32, F16))
def _im2col(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, x_t, FLOATS, "input")
    is_2d = int(params_i32(node)[6]) != 0
    s, p, d = _conv_params(node, is_2d)
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
    # ggml's CPU backend lays the input's patches out in the kernel's type before the product: an F16 kernel
    # multiplies F16-rounded input.
    x = through_type(k_t.type, read(mem, x_t))
    cols = _columns(x, kw, kh, s, p, d, ow, oh).reshape(n, oh * ow, c * kh * kw)
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


@kernel(GgmlOp.UPSCALE, src=FLOATS, dst=(F32,), note="nearest (all dims); bilinear, bicubic, antialiased (dims 0, 1)")
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
    if mode not in (1, 2):
        raise node_error(node, f"upscale mode {mode} is not supported (nearest 0, bilinear 1, bicubic 2)")
    if flags & (1 << 9):
        if mode != 1 or align_corners:
            raise node_error(node, "antialias applies to bilinear upscale without aligned corners only")
        write(mem, node, _antialiased(x, src_shape, dst_shape))
        return
    # Dims 2 and 3 are resampled by nearest neighbour (ggml interpolates dims 0 and 1 only): index
    # trunc(i / (out / in)) in float32, as ggml computes it.
    for axis in (0, 1):
        n_in, n_out = src_shape[axis], dst_shape[axis]
        if n_in != n_out:
            sf = np.float32(n_out) / np.float32(n_in)
            near = np.minimum((np.arange(n_out, dtype=np.float32) / sf).astype(np.int64), n_in - 1)
            x = np.take(x, near, axis=axis)
    out = x
    for axis in (2, 3):
        n_in, n_out = src_shape[axis], dst_shape[axis]
        # ggml: source position (i + offset) / sf - offset in float32; aligned corners drop the half-pixel
        # offset and stretch by (out - 1) / (in - 1) when both sides have more than one pixel.
        po = np.float32(0) if align_corners else np.float32(0.5)
        sf = np.float32(n_out) / np.float32(n_in)
        if align_corners and n_out > 1 and n_in > 1:
            sf = np.float32(n_out - 1) / np.float32(n_in - 1)
        pos = (np.arange(n_out, dtype=np.float32) + po) / sf - po
        i0 = np.floor(pos).astype(np.int64)
        frac = (pos - i0).astype(np.float32)
        shape = [1, 1, 1, 1]
        shape[axis] = n_out
        frac = frac.reshape(shape)
        if mode == 1:
            lo = np.clip(i0, 0, n_in - 1)
            hi = np.clip(i0 + 1, 0, n_in - 1)
            out = np.take(out, lo, axis=axis) * (1 - frac) + np.take(out, hi, axis=axis) * frac
            continue
        # Bicubic: four neighbours (clamped at the edges) weighted by Keys' cubic with a = -0.75.
        acc = np.zeros(1, dtype=np.float32)
        for off, w in zip((-1, 0, 1, 2), _cubic_weights(frac), strict=True):
            acc = acc + np.take(out, np.clip(i0 + off, 0, n_in - 1), axis=axis) * w
        out = acc
    write(mem, node, out)


def _antialiased(x: np.ndarray, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> np.ndarray:
    """Antialiased bilinear resampling of dims 0 and 1 (dims 2 and 3 by nearest neighbour).

    Along each axis, output o is centred on source position c = (o + 0.5) * in / out; source j (centre j + 0.5)
    weighs max(0, 1 - |j + 0.5 - c| / s) with the triangle widened to s = max(in / out, 1) when shrinking, and
    each output's weights are divided by their sum (so edges are not darkened). One matrix per axis, applied with
    a matmul over the whole tensor.
    """
    for axis in (2, 3):  # numpy axes 2 and 3: ggml dims 1 and 0
        n_in, n_out = src_shape[axis], dst_shape[axis]
        ratio = np.float32(n_in) / np.float32(n_out)
        support = max(ratio, np.float32(1))
        centre = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * ratio
        dist = np.abs(np.arange(n_in, dtype=np.float32)[None, :] + np.float32(0.5) - centre[:, None]) / support
        w = np.maximum(np.float32(0), np.float32(1) - dist)
        w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)  # (out, in)
        x = np.moveaxis(np.moveaxis(x, axis, -1) @ w.T, -1, axis)
    for axis in (0, 1):
        n_in, n_out = src_shape[axis], dst_shape[axis]
        if n_in != n_out:
            sf = np.float32(n_out) / np.float32(n_in)
            x = np.take(x, np.minimum((np.arange(n_out, dtype=np.float32) / sf).astype(np.int64), n_in - 1), axis=axis)
    return x


def _cubic_weights(t: np.ndarray) -> tuple[np.ndarray, ...]:
    """Keys' cubic convolution weights (a = -0.75) of the neighbours at -1, 0, +1, +2 for a fraction t."""
    a = np.float32(-0.75)

    def near(x: np.ndarray) -> np.ndarray:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: np.ndarray) -> np.ndarray:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    one, two = np.float32(1), np.float32(2)
    return far(t + one), near(t), near(one - t), far(two - t)


def _columns_3d(x: np.ndarray, k: tuple[int, int, int], s: tuple[int, ...], p: tuple[int, ...], d: tuple[int, ...],
                o: tuple[int, int, int]) -> np.ndarray:
    """x (N, C, D, H, W) -> columns (N, OD, OH, OW, C, KD, KH, KW), zero outside the input; k, s, p, d and the
    output sizes o are given width first, as ggml orders them."""
    size = x.shape[4], x.shape[3], x.shape[2]
    idx, ok = [], []
    for ax in range(3):  # width, height, depth: (O, K) source positions and their validity
        i = np.arange(o[ax])[:, None] * s[ax] + np.arange(k[ax])[None, :] * d[ax] - p[ax]
        idx.append(np.clip(i, 0, max(size[ax] - 1, 0)))
        ok.append((i >= 0) & (i < size[ax]))
    iw, ih, idp = idx
    g = x[:, :, idp[:, :, None, None, None, None], ih[None, None, :, :, None, None], iw[None, None, None, None, :, :]]
    # g: (N, C, OD, KD, OH, KH, OW, KW)
    mask = ok[2][:, :, None, None, None, None] & ok[1][None, None, :, :, None, None] & ok[0][None, None, None, None]
    g = g * mask
    return g.transpose(0, 2, 4, 6, 1, 3, 5, 7)


def _params_3d(node: GraphTensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    v = [int(x) for x in params_i32(node)[:9]]
    s, p, d = tuple(v[0:3]), tuple(v[3:6]), tuple(v[6:9])
    if min(s) <= 0 or min(d) <= 0 or min(p) < 0:
        raise node_error(node, "strides and dilations must be positive, paddings non-negative")
    return s, p, d


@kernel(GgmlOp.IM2COL_3D, src=FLOATS, dst=(F32, F16), note="input [W, H, D, N*IC]; params s0-2, p0-2, d0-2, IC")
def _im2col_3d(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, x_t, FLOATS, "input")
    s, p, d = _params_3d(node)
    ic = int(params_i32(node)[9])
    kw, kh, kd = (int(v) for v in k_t.ne[:3])
    w, h, dp, nc = (int(v) for v in x_t.ne)
    if ic <= 0 or nc % ic:
        raise node_error(node, f"input dim 3 ({nc}) is not a multiple of the channel count {ic}")
    n = nc // ic
    o = (_out_size(w, kw, s[0], p[0], d[0]), _out_size(h, kh, s[1], p[1], d[1]), _out_size(dp, kd, s[2], p[2], d[2]))
    want = (kw * kh * kd * ic, o[0], o[1], o[2] * n)
    if min(o) <= 0 or tuple(node.ne) != want:
        raise node_error(node, f"result must be {list(want)} for this kernel and input")
    x = read(mem, x_t).reshape(n, ic, dp, h, w)
    cols = _columns_3d(x, (kw, kh, kd), s, p, d, o)  # (N, OD, OH, OW, IC, KD, KH, KW)
    write(mem, node, cols.reshape(shape4(node)))


@kernel(GgmlOp.CONV_3D, src=FLOATS, dst=(F32,), note="kernel [KW, KH, KD, IC*OC], input [W, H, D, IC*N]")
def _conv_3d(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, k_t, FLOATS, "kernel")
    need_types(node, x_t, FLOATS, "input")
    s, p, d = _params_3d(node)
    c, n, oc = (int(v) for v in params_i32(node)[9:12])
    kw, kh, kd, kc = (int(v) for v in k_t.ne)
    w, h, dp, xc = (int(v) for v in x_t.ne)
    if c <= 0 or kc != c * oc or xc != c * n:
        raise node_error(node, "kernel dim 3 must be IC*OC and input dim 3 IC*N")
    o = (_out_size(w, kw, s[0], p[0], d[0]), _out_size(h, kh, s[1], p[1], d[1]), _out_size(dp, kd, s[2], p[2], d[2]))
    if min(o) <= 0 or tuple(node.ne) != (o[0], o[1], o[2], oc * n):
        raise node_error(node, f"result must be [{o[0]}, {o[1]}, {o[2]}, {oc * n}]")
    x = through_type(k_t.type, read(mem, x_t))  # patches in the kernel's type, as for CONV_2D
    cols = _columns_3d(x.reshape(n, c, dp, h, w), (kw, kh, kd), s, p, d, o)
    cols = cols.reshape(n, o[2] * o[1] * o[0], c * kd * kh * kw)
    kmat = read(mem, k_t).reshape(oc, c * kd * kh * kw)
    out = np.matmul(cols, kmat.T)  # (N, OD*OH*OW, OC)
    write(mem, node, out.transpose(0, 2, 1).reshape(n * oc, o[2], o[1], o[0]))


@kernel(GgmlOp.POOL_1D, src=(F32,), dst=(F32,), note="MAX and AVG over dim 0")
def _pool_1d(node: GraphTensor, mem: Memory) -> None:
    x_t = src(node, 0)
    need_types(node, x_t, (F32,), "input")
    op, k0, s0, p0 = (int(v) for v in params_i32(node)[:4])
    w = int(x_t.ne[0])
    if op not in (0, 1) or k0 <= 0 or s0 <= 0 or p0 < 0:
        raise node_error(node, "pool op must be MAX (0) or AVG (1) with positive kernel and stride")
    ow = _cdiv(w + 2 * p0 - k0, s0) + 1
    if ow <= 0 or tuple(node.ne) != (ow, *x_t.ne[1:]):
        raise node_error(node, f"result must be [{ow}, {', '.join(str(int(v)) for v in x_t.ne[1:])}]")
    x = read(mem, x_t)
    fill = np.float32(-np.finfo(np.float32).max) if op == 0 else np.float32(0)
    padded = np.full((*x.shape[:3], w + 2 * p0 + k0), fill, dtype=np.float32)
    padded[..., p0 : p0 + w] = x
    at = (np.arange(ow) * s0)[:, None] + np.arange(k0)[None, :]  # padded positions of each window
    win = padded[..., at]  # (..., OW, K0)
    if op == 0:
        write(mem, node, win.max(axis=-1))
        return
    # The average is over the window's positions inside the input: padding is not counted.
    inside = ((at >= p0) & (at < p0 + w)).sum(axis=-1).astype(np.float32)
    write(mem, node, win.sum(axis=-1) / np.maximum(inside, np.float32(1)))


@kernel(GgmlOp.CONV_TRANSPOSE_1D, src=FLOATS, dst=(F32,), note="kernel [K, OC, IC], input [L, IC]; p0 0, d0 1")
def _conv_transpose_1d(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, k_t, FLOATS, "kernel")
    need_types(node, x_t, (F32,), "input")
    s0, p0, d0 = (int(v) for v in params_i32(node)[:3])
    k, oc, ic = (int(v) for v in k_t.ne[:3])
    length, ic1 = int(x_t.ne[0]), int(x_t.ne[1])
    out_len = (length - 1) * s0 + k
    if s0 <= 0 or p0 != 0 or d0 != 1 or ic != ic1 or k_t.ne[3] != 1 or x_t.ne[2] != 1 or x_t.ne[3] != 1:
        raise node_error(node, "ggml's transposed 1-D convolution takes stride > 0, padding 0, dilation 1")
    if tuple(node.ne) != (out_len, oc, 1, 1):
        raise node_error(node, f"result must be [{out_len}, {oc}, 1, 1]")
    kern = read(mem, k_t)[0]  # (IC, OC, K)
    x = read(mem, x_t)[0, 0]  # (IC, L)
    contrib = np.einsum("il,iok->olk", x, kern, dtype=np.float32)  # input position l, tap k -> l * s0 + k
    out = np.zeros((oc, out_len), dtype=np.float32)
    at = (np.arange(length)[:, None] * s0 + np.arange(k)[None, :]).reshape(-1)
    np.add.at(out, (slice(None), at), contrib.reshape(oc, -1))
    write(mem, node, out[None, None])
