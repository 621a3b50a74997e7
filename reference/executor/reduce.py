"""Reductions and orderings along rows: SUM, SUM_ROWS, MEAN, ARGMAX, ARGSORT, TOP_K, CUMSUM."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from ggml_rpc.spec import TYPES, GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, nelements, params_i32, read, src, write
from .memory import F32, I32, Memory, node_error


def _input(node: GraphTensor, mem: Memory) -> np.ndarray:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    return read(mem, a_t)


def _rows_shape(node: GraphTensor, width: int) -> None:
    a_t = src(node, 0)
    if tuple(node.ne) != (width, *tuple(a_t.ne[1:])):
        raise node_error(node, f"result must be [{width}, src.ne1, src.ne2, src.ne3]")


@kernel(GgmlOp.SUM, src=FLOATS, dst=FLOATS, note="each row's ne0 elements read from its start, as ggml's CPU SUM")
def _sum(node: GraphTensor, mem: Memory) -> None:
    if nelements(node) != 1:
        raise node_error(node, "result must be a scalar")
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    size = TYPES[a_t.type].size
    if a_t.nb[0] != size:
        # ggml's CPU SUM sums ne0 consecutive elements from each row's first byte, whatever nb0 says (a source
        # permuted in dims 0 and 1 gives another sum than its elements'); test-backend-ops holds every backend to
        # that. The view is bounds-checked against the buffer like any other.
        a_t = replace(a_t, nb=(size, *a_t.nb[1:]))
    write(mem, node, np.float32(read(mem, a_t).sum(dtype=np.float64)))


@kernel(GgmlOp.SUM_ROWS, src=FLOATS, dst=FLOATS)
def _sum_rows(node: GraphTensor, mem: Memory) -> None:
    _rows_shape(node, 1)
    write(mem, node, _input(node, mem).sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32))


@kernel(GgmlOp.MEAN, src=FLOATS, dst=FLOATS)
def _mean(node: GraphTensor, mem: Memory) -> None:
    _rows_shape(node, 1)
    write(mem, node, _input(node, mem).mean(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32))


@kernel(GgmlOp.ARGMAX, src=(F32,), dst=(I32,))
def _argmax(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, (F32,), "source 0")
    if node.type != I32 or tuple(node.ne) != (a_t.ne[1], 1, 1, 1) or a_t.ne[2] != 1 or a_t.ne[3] != 1:
        raise node_error(node, "ARGMAX takes a matrix and gives I32 [rows]")
    x = read(mem, a_t)[0, 0]
    write(mem, node, np.argmax(x, axis=-1).astype(np.int32)[None, None, None, :])


@kernel(GgmlOp.ARGSORT, src=(F32,), dst=(I32,), note="ascending or descending")
def _argsort(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, (F32,), "source 0")
    if node.type != I32 or tuple(node.ne) != tuple(a_t.ne):
        raise node_error(node, "ARGSORT gives I32 of the source's shape")
    order = int(params_i32(node)[0])
    x = read(mem, a_t)
    idx = np.argsort(-x if order == 1 else x, axis=-1, kind="stable")
    write(mem, node, idx.astype(np.int32))


@kernel(GgmlOp.TOP_K, src=(F32,), dst=(I32,), note="indices of the k largest, largest first (ties in the order of the "
        "C++ library's heap-based partial sort), then the first two swapped (as ggml's CPU backend returns them)")
def _top_k(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, (F32,), "source 0")
    k = int(node.ne[0])
    if node.type != I32 or k > a_t.ne[0] or tuple(node.ne[1:]) != tuple(a_t.ne[1:]):
        raise node_error(node, "TOP_K gives I32 [k <= ne0, src.ne1, src.ne2, src.ne3]")
    from .partial_sort import top_k_rows

    x = read(mem, a_t)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    idx = np.empty((rows.shape[0], k), dtype=np.int32)
    if k > 0:
        # The order among equal values is the standard library's partial sort's, not the first index's.
        top_k_rows(rows, k, idx)
    idx = idx.reshape(*x.shape[:-1], k)
    if k > 1:
        # ggml's CPU backend swaps its first two results on purpose, so that no caller relies on the order; a
        # server that computes as upstream does returns the same indices in the same places.
        idx[..., [0, 1]] = idx[..., [1, 0]]
    write(mem, node, idx.astype(np.int32))


@kernel(GgmlOp.CUMSUM, src=FLOATS, dst=FLOATS)
def _cumsum(node: GraphTensor, mem: Memory) -> None:
    _rows_shape(node, int(src(node, 0).ne[0]))
    write(mem, node, np.cumsum(_input(node, mem), axis=-1, dtype=np.float32))


# The backward/training kernels and the lightning indexer live in their own modules; importing them here
# registers them with the executor.
from . import deconv, dsv4, indexer, recurrent, training  # noqa: E402, F401
