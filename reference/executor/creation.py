"""Ops that produce values from their parameters or mask a source by position: ARANGE, TRI,
TIMESTEP_EMBEDDING."""

from __future__ import annotations

import math

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, nelements, params_f32, params_i32, read, same_shape, src, write
from .memory import F32, Memory, node_error


@kernel(GgmlOp.ARANGE, src=(), dst=(F32,))
def _arange(node: GraphTensor, mem: Memory) -> None:
    start, _stop, step = (np.float32(v) for v in params_f32(node)[:3])
    n = nelements(node)
    write(mem, node, (start + step * np.arange(n, dtype=np.float32)).reshape(1, 1, 1, n))


# TRI keeps the elements whose (column, row) satisfy the predicate and zeroes the rest.
_TRI = {
    0: lambda col, row: col >= row,  # upper with diagonal
    1: lambda col, row: col > row,  # upper
    2: lambda col, row: col <= row,  # lower with diagonal
    3: lambda col, row: col < row,  # lower
}


@kernel(GgmlOp.TRI, src=FLOATS, dst=FLOATS)
def _tri(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    same_shape(node, a_t)
    pred = _TRI.get(int(params_i32(node)[0]))
    if pred is None:
        raise node_error(node, f"triangle type {int(params_i32(node)[0])} is not 0..3")
    x = read(mem, a_t)
    keep = pred(np.arange(x.shape[-1])[None, :], np.arange(x.shape[-2])[:, None])
    write(mem, node, np.where(keep, x, np.float32(0)))


@kernel(GgmlOp.TIMESTEP_EMBEDDING, src=(F32,), dst=(F32,))
def _timestep_embedding(node: GraphTensor, mem: Memory) -> None:
    # Row i: cos(t_i * f_j) for j < dim / 2, then sin(t_i * f_j), f_j = exp(-ln(max_period) * j / half); rest 0.
    t_t = src(node, 0)
    need_types(node, t_t, (F32,), "timesteps")
    dim, max_period = (int(v) for v in params_i32(node)[:2])
    n = int(t_t.ne[0])
    width = int(node.ne[0])
    if dim <= 0 or width < dim or tuple(node.ne[1:]) != (n, 1, 1) or max_period <= 0:
        raise node_error(node, "result must be [>= dim, timesteps] with a positive dim and max_period")
    half = dim // 2
    freqs = np.exp(-math.log(max_period) * np.arange(half, dtype=np.float32) / np.float32(half)).astype(np.float32)
    args = read(mem, t_t).reshape(-1)[:n, None] * freqs[None, :]
    out = np.zeros((n, width), dtype=np.float32)
    out[:, :half] = np.cos(args)
    out[:, half : 2 * half] = np.sin(args)
    write(mem, node, out[None, None])
