"""SOFT_MAX (scale, mask, ALiBi slopes, attention sinks) and DIAG_MASK_INF."""

from __future__ import annotations

import math

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_f32, params_i32, read, same_shape, src, write
from .libm import powf
from .memory import F16, F32, Memory, node_error


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """Per-head ALiBi slope (all 1 when max_bias is 0), as float32 of shape (n_head,): ggml's m0 and m1 and each
    head's power of them with the C library's powf, as upstream computes them (numpy's float32 power differs from
    powf by an ulp for some heads: measured against upstream 7.0.0's FLASH_ATTN_EXT with 16 heads and max_bias 8)."""
    if max_bias <= 0:
        return np.ones(n_head, dtype=np.float32)
    n_head_log2 = 1 << math.floor(math.log2(n_head)) if n_head > 0 else 1
    bias = np.float32(max_bias)
    m0 = powf(2.0, np.float32(-bias / np.float32(n_head_log2)))
    m1 = powf(2.0, np.float32(-(bias / np.float32(2)) / np.float32(n_head_log2)))
    return np.array([powf(m0, h + 1) if h < n_head_log2 else powf(m1, 2 * (h - n_head_log2) + 1)
                     for h in range(n_head)], dtype=np.float32)


def broadcast_mask(node: GraphTensor, mask: np.ndarray, rows: int, heads: int, seqs: int, cols: int,
                   lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The mask for score rows [lo, hi) of a (seqs, heads, rows, cols) array: mask dims 2/3 repeat by modulo (a
    broadcastable view when they are 1), and the mask must hold every row and column the scores have."""
    m3, m2, m1, m0 = mask.shape
    if m0 < cols or m1 < rows or m2 == 0 or m3 == 0 or heads % m2 or seqs % m3:
        raise node_error(node, "mask is too small for (or does not broadcast to) the scores")
    part = mask[:, :, lo : rows if hi is None else hi, :cols]
    if m2 == 1 and m3 == 1:
        return part
    return np.tile(part, (seqs // m3, heads // m2, 1, 1))


@kernel(GgmlOp.SOFT_MAX, src=FLOATS, dst=(F32,), note="mask F16/F32, ALiBi, sinks")
def _soft_max(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    same_shape(node, a_t)
    p = params_f32(node)
    scale, max_bias = p[0], float(p[1])
    x = read(mem, a_t) * scale
    n3, n2, n1, n0 = x.shape
    mask_t = node.src[1]
    if mask_t is not None:
        need_types(node, mask_t, (F16, F32), "mask")
        mask = broadcast_mask(node, read(mem, mask_t), n1, n2, n3, n0)
        slopes = alibi_slopes(n2, max_bias)[None, :, None, None]
        x = x + (slopes * mask if max_bias > 0 else mask)
    sinks_t = node.src[2]
    mx = x.max(axis=-1, keepdims=True)
    if sinks_t is not None:
        need_types(node, sinks_t, (F32,), "sinks")
        if sinks_t.ne[0] < n2:
            raise node_error(node, "sinks need one value per head")
        sinks = read(mem, sinks_t).reshape(-1)[:n2][None, :, None, None]
        mx = np.maximum(mx, sinks)
    e = np.exp(x - mx)
    total = e.sum(axis=-1, keepdims=True, dtype=np.float64)
    if sinks_t is not None:
        total = total + np.exp(sinks - mx)
    write(mem, node, e * (1.0 / total).astype(np.float32))


@kernel(GgmlOp.DIAG_MASK_INF, src=FLOATS, dst=FLOATS)
def _diag_mask_inf(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    same_shape(node, a_t)
    n_past = int(params_i32(node)[0])
    x = read(mem, a_t)
    cols = np.arange(x.shape[-1])[None, :]
    rows = np.arange(x.shape[-2])[:, None]
    write(mem, node, np.where(cols > n_past + rows, np.float32(-np.inf), x))
