"""Ops that move or rearrange values: CPY, DUP, CONT, CONCAT, REPEAT, ACC, SET, PAD.

ACC and SET place a window described by byte strides from op_params inside the result; those strides are signed
peer input, so the whole window is checked against the result's own bytes before anything is written.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import TYPES, GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, READABLE, WRITABLE, kernel, need_types, nelements, params_i32, read, src, write
from .memory import F16, F32, I32, PLAIN_DTYPES, Memory, extent, node_error, shape4


def _copy(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    if nelements(a_t) != nelements(node):
        raise node_error(node, "source and result hold different numbers of elements")
    if a_t.type == node.type and (node.type in PLAIN_DTYPES or a_t.ne[0] % TYPES[a_t.type].blck == 0):
        # Same type: a plain element (or whole block) copy in ggml's row-major order, no conversion; a quantised
        # source of another shape (permuted, reshaped) is walked block by block in its logical order, as ggml's
        # byte-wise dup walks it.
        raw_a = mem.raw(a_t)
        raw_d = mem.raw(node)
        np.copyto(raw_d, raw_a.reshape(raw_d.shape))
        return
    need_types(node, a_t, _COPY_SRC, "source 0")
    if node.type not in _COPY_DST:
        raise node_error(node, "result type cannot be written")
    if a_t.type == I32 or node.type == I32:
        # Integer <-> float conversions go through float64 so no I32 value loses precision on the way.
        raw = mem.raw(a_t)
        vals = raw.astype(np.float64) if a_t.type == I32 else read(mem, a_t)
        np.copyto(mem.raw(node), vals.reshape(shape4(node)), casting="unsafe")
        return
    write(mem, node, read(mem, a_t).reshape(shape4(node)))


_COPY_SRC = (*READABLE, I32)
_COPY_DST = (*WRITABLE, I32)
for _op in (GgmlOp.CPY, GgmlOp.DUP, GgmlOp.CONT):
    kernel(_op, src=_COPY_SRC, dst=_COPY_DST, note="same-type copies move bytes; F32 <-> I32 truncates")(_copy)


@kernel(GgmlOp.CONCAT, src=(*READABLE, I32), dst=(*READABLE, I32),
        note="sources of the result's type are joined as stored (quantised: whole blocks)")
def _concat(node: GraphTensor, mem: Memory) -> None:
    a_t, b_t = src(node, 0), src(node, 1)
    dim = int(params_i32(node)[0])
    if not 0 <= dim < 4:
        raise node_error(node, f"concat dimension {dim} is not 0..3")
    for d in range(4):
        want = a_t.ne[d] + b_t.ne[d] if d == dim else a_t.ne[d]
        if node.ne[d] != want or (d != dim and b_t.ne[d] != a_t.ne[d]):
            raise node_error(node, f"shapes do not concatenate along dimension {dim}")
    axis = 3 - dim  # a quantised raw view keeps dims 3..1 first and its block axis where dim 0 is
    blck = TYPES[node.type].blck
    if a_t.type == b_t.type == node.type and (node.type in PLAIN_DTYPES or a_t.ne[0] % blck == b_t.ne[0] % blck == 0):
        np.copyto(mem.raw(node), np.concatenate((mem.raw(a_t), mem.raw(b_t)), axis=axis))
        return
    need_types(node, a_t, FLOATS, "source 0")
    need_types(node, b_t, FLOATS, "source 1")
    write(mem, node, np.concatenate((read(mem, a_t), read(mem, b_t)), axis=axis))


@kernel(GgmlOp.REPEAT, src=FLOATS, dst=FLOATS)
def _repeat(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    if any(a <= 0 or d % a for a, d in zip(a_t.ne, node.ne, strict=True)):
        raise node_error(node, "result dims must be whole multiples of the source's")
    reps = tuple(d // a for a, d in zip(shape4(a_t), shape4(node), strict=True))
    if a_t.type == node.type and node.type in PLAIN_DTYPES:
        np.copyto(mem.raw(node), np.tile(mem.raw(a_t), reps))
        return
    write(mem, node, np.tile(read(mem, a_t), reps))


def _window(node: GraphTensor, b_t: GraphTensor, esize: int = 4) -> tuple[int, tuple[int, int, int, int]]:
    """Offset and byte strides of the ACC/SET window, checked to stay inside the result's memory."""
    p = params_i32(node)
    nb1, nb2, nb3, offset = (int(x) for x in p[:4])
    ne = [int(n) for n in b_t.ne]
    strides = (esize, nb1, nb2, nb3)
    if offset < 0 or any(s % esize for s in strides) or offset % esize:
        raise node_error(node, "window offset/strides must be non-negative multiples of the element size")
    if any(n == 0 for n in ne):
        return offset, (0, 0, 0, 0)
    # Every corner of the window must land inside the result: with signed strides the extremes are at corners.
    lo = hi = offset
    for n, s in zip(ne, strides, strict=True):
        reach = (n - 1) * s
        lo += min(0, reach)
        hi += max(0, reach)
    if lo < 0 or hi + esize > extent(node):
        raise node_error(node, f"window bytes [{lo}, {hi + esize}) leave the result's {extent(node)} bytes")
    return offset, strides


def _acc_set(node: GraphTensor, mem: Memory, add: bool) -> None:
    a_t, b_t = src(node, 0), src(node, 1)
    # ACC adds in F32; SET copies elements of any plain type, all three tensors of the same type.
    allowed = (F32,) if add else tuple(_SET_TYPES)
    for t, role in ((a_t, "source 0"), (b_t, "source 1"), (node, "result")):
        if t.type not in allowed or t.type != node.type:
            raise node_error(node, f"{role} must be {'F32' if add else 'of the result type (F32, F16, I32)'}")
    if tuple(a_t.ne) != tuple(node.ne):
        raise node_error(node, "source 0 shape differs from the result's")
    esize = PLAIN_DTYPES[node.type].itemsize
    nbd = node.nb
    contiguous = (nbd[1] == esize * node.ne[0] and nbd[2] == nbd[1] * node.ne[1]
                  and nbd[3] == nbd[2] * node.ne[2])
    if nbd[0] != esize or not contiguous:
        raise node_error(node, "result must be contiguous")
    offset, strides = _window(node, b_t, esize)
    inplace = int(params_i32(node)[4]) != 0
    out = mem.raw(node)
    if not inplace:
        np.copyto(out, mem.raw(a_t))
    if nelements(b_t) == 0:
        return
    flat = out.reshape(-1)  # contiguous result: element index = byte offset / element size
    ne = [int(n) for n in b_t.ne]
    el = [s // esize for s in strides]
    idx = (
        offset // esize
        + np.arange(ne[3])[:, None, None, None] * el[3]
        + np.arange(ne[2])[None, :, None, None] * el[2]
        + np.arange(ne[1])[None, None, :, None] * el[1]
        + np.arange(ne[0])[None, None, None, :] * el[0]
    )
    if add:
        flat[idx] = flat[idx] + read(mem, b_t)
    else:
        flat[idx] = mem.raw(b_t)  # raw values: no conversion, integers stay exact


_SET_TYPES = (F32, F16, I32)
kernel(GgmlOp.ACC, src=(F32,), dst=(F32,))(lambda node, mem: _acc_set(node, mem, True))
kernel(GgmlOp.SET, src=_SET_TYPES, dst=_SET_TYPES, note="any of these types, all tensors the same")(
    lambda node, mem: _acc_set(node, mem, False))


@kernel(GgmlOp.PAD, src=FLOATS, dst=FLOATS, note="zeros, or circular (op_params[8])")
def _pad(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    p = [int(x) for x in params_i32(node)[:8]]
    circular = int(params_i32(node)[8]) != 0
    lp, rp = p[0::2], p[1::2]
    if any(x < 0 for x in p):
        raise node_error(node, "negative padding")
    for d in range(4):
        if node.ne[d] != a_t.ne[d] + lp[d] + rp[d]:
            raise node_error(node, f"result dim {d} is not source + left + right padding")
    x = read(mem, a_t)
    if circular:
        if min(int(n) for n in a_t.ne) <= 0:
            raise node_error(node, "circular padding of an empty source")
        # Result index i of each dim reads the source at (i - left) modulo its size: the far side wraps in.
        idx = [(np.arange(int(node.ne[d])) - lp[d]) % int(a_t.ne[d]) for d in (3, 2, 1, 0)]
        write(mem, node, x[np.ix_(*idx)])
        return
    out = np.zeros(shape4(node), dtype=np.float32)
    sl = tuple(slice(lp[d], lp[d] + int(a_t.ne[d])) for d in (3, 2, 1, 0))
    out[sl] = x
    write(mem, node, out)


@kernel(GgmlOp.PAD_REFLECT_1D, src=(F32,), dst=(F32,), note="dim 0, mirrored without repeating the edge")
def _pad_reflect_1d(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    p0, p1 = (int(v) for v in params_i32(node)[:2])
    n0 = int(a_t.ne[0])
    if p0 < 0 or p1 < 0 or p0 >= n0 or p1 >= n0 or tuple(node.ne) != (n0 + p0 + p1, *a_t.ne[1:]):
        raise node_error(node, "reflect padding must be smaller than dim 0 and the result dim 0 source + padding")
    write(mem, node, np.pad(read(mem, a_t), ((0, 0), (0, 0), (0, 0), (p0, p1)), mode="reflect"))


@kernel(GgmlOp.ROLL, src=FLOATS, dst=FLOATS, note="shifts per dim from op_params, wrapping around")
def _roll(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    if tuple(a_t.ne) != tuple(node.ne):
        raise node_error(node, "source shape differs from the result's")
    shifts = [int(v) for v in params_i32(node)[:4]]
    write(mem, node, np.roll(read(mem, a_t), shift=shifts[::-1], axis=(0, 1, 2, 3)))


@kernel(GgmlOp.DIAG, src=FLOATS, dst=FLOATS, note="a row [n, 1, ...] to an n x n diagonal matrix")
def _diag(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    n = int(a_t.ne[0])
    if a_t.ne[1] != 1 or tuple(node.ne) != (n, n, a_t.ne[2], a_t.ne[3]):
        raise node_error(node, "source must be [n, 1, a, b] and the result [n, n, a, b]")
    x = read(mem, a_t)  # (b, a, 1, n)
    write(mem, node, np.where(np.eye(n, dtype=bool), x, np.float32(0)))  # row i keeps element i only
