"""SOFT_MAX (scale, mask, ALiBi slopes, attention sinks; its rows compiled in :mod:`.softmax_rows`, in upstream's
arithmetic) and DIAG_MASK_INF."""

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
    from .softmax_rows import soft_max_rows

    p = params_f32(node)
    scale, max_bias = p[0], float(p[1])
    x = np.ascontiguousarray(read(mem, a_t), dtype=np.float32)
    n3, n2, n1, n0 = x.shape
    mask_t, sinks_t = node.src[1], node.src[2]
    mask = np.zeros((1, 1, 1, 1), dtype=np.float32)
    if mask_t is not None:
        need_types(node, mask_t, (F16, F32), "mask")
        raw = mem.raw(mask_t)
        broadcast_mask(node, raw, n1, n2, n3, n0, 0, 0)  # the shape check
        mask = np.ascontiguousarray(read(mem, mask_t)[:, :, :n1, :n0], dtype=np.float32)
    sinks = np.zeros(n2, dtype=np.float32)
    if sinks_t is not None:
        need_types(node, sinks_t, (F32,), "sinks")
        if sinks_t.ne[0] < n2:
            raise node_error(node, "sinks need one value per head")
        sinks = np.ascontiguousarray(read(mem, sinks_t).reshape(-1)[:n2], dtype=np.float32)
    out = np.empty(x.shape, dtype=np.float32)
    if out.size:
        soft_max_rows(x, float(scale), mask, mask_t is not None, alibi_slopes(n2, max_bias), sinks,
                      sinks_t is not None, out)
    write(mem, node, out)


@kernel(GgmlOp.DIAG_MASK_INF, src=FLOATS, dst=FLOATS)
def _diag_mask_inf(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    same_shape(node, a_t)
    n_past = int(params_i32(node)[0])
    x = read(mem, a_t)
    cols = np.arange(x.shape[-1])[None, :]
    rows = np.arange(x.shape[-2])[:, None]
    write(mem, node, np.where(cols > n_past + rows, np.float32(-np.inf), x))
