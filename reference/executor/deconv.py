"""CONV_TRANSPOSE_2D and CONV_2D_DW (depthwise): one numpy contraction per kernel tap, over the whole tensor."""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_i32, read, src, write
from .memory import F32, Memory, node_error
from .types import through_type


@kernel(GgmlOp.CONV_TRANSPOSE_2D, src=FLOATS, dst=(F32,), note="kernel [KW, KH, OC, IC], input [W, H, IC, N]")
def _conv_transpose_2d(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, k_t, FLOATS, "kernel")
    need_types(node, x_t, (F32,), "input")
    stride = int(params_i32(node)[0])
    kw, kh, oc, ic = (int(v) for v in k_t.ne)
    w, h, ic1, n = (int(v) for v in x_t.ne)
    ow, oh = (w - 1) * stride + kw, (h - 1) * stride + kh
    if stride <= 0 or ic != ic1:
        raise node_error(node, "stride must be positive and the kernel's ne3 the input's channels")
    if tuple(node.ne) != (ow, oh, oc, n):
        raise node_error(node, f"result must be [{ow}, {oh}, {oc}, {n}]")
    kern = read(mem, k_t)  # (IC, OC, KH, KW)
    # ggml's CPU backend copies the input into the kernel's type before its dot products (F16-rounded for F16).
    x = through_type(k_t.type, read(mem, x_t))  # (N, IC, H, W)
    out = np.zeros((n, oc, oh, ow), dtype=np.float32)
    for ky in range(kh):  # taps: bounded by the kernel's own size, each a contraction over every pixel
        for kx in range(kw):
            contrib = np.einsum("nihw,io->nohw", x, kern[:, :, ky, kx], dtype=np.float32)
            out[:, :, ky : ky + (h - 1) * stride + 1 : stride, kx : kx + (w - 1) * stride + 1 : stride] += contrib
    write(mem, node, out)


@kernel(GgmlOp.CONV_2D_DW, src=FLOATS, dst=(F32,), note="kernel [KW, KH, 1, C], input [W, H, C, N] (any layout)")
def _conv_2d_dw(node: GraphTensor, mem: Memory) -> None:
    k_t, x_t = src(node, 0), src(node, 1)
    need_types(node, k_t, FLOATS, "kernel")
    need_types(node, x_t, (F32,), "input")
    s0, s1, p0, p1, d0, d1 = (int(v) for v in params_i32(node)[:6])
    kw, kh, one, c = (int(v) for v in k_t.ne)
    w, h, c1, n = (int(v) for v in x_t.ne)
    if min(s0, s1, d0, d1) <= 0 or p0 < 0 or p1 < 0 or one != 1 or c != c1:
        raise node_error(node, "kernel must be [KW, KH, 1, C] for a [W, H, C, N] input; positive strides, dilations")
    ow, oh = (w + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1, (h + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
    if ow <= 0 or oh <= 0 or tuple(node.ne) != (ow, oh, c, n):
        raise node_error(node, f"result must be [{ow}, {oh}, {c}, {n}]")
    kern = read(mem, k_t)[:, 0]  # (C, KH, KW)
    padded = np.zeros((n, c, h + 2 * p1, w + 2 * p0), dtype=np.float32)
    padded[:, :, p1 : p1 + h, p0 : p0 + w] = read(mem, x_t)
    out = np.zeros((n, c, oh, ow), dtype=np.float32)
    for ky in range(kh):  # taps: bounded by the kernel's size; each a strided window of the padded input
        for kx in range(kw):
            win = padded[:, :, ky * d1 : ky * d1 + (oh - 1) * s1 + 1 : s1, kx * d0 : kx * d0 + (ow - 1) * s0 + 1 : s0]
            out += win * kern[None, :, ky, kx, None, None]
    write(mem, node, out)
