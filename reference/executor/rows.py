"""GET_ROWS and SET_ROWS: gather and scatter of whole rows, every index range-checked before memory is touched."""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import READABLE, WRITABLE, kernel, need_types, read_index, src
from .memory import BF16, F16, F32, I32, PLAIN_DTYPES, Memory, node_error
from .types import bf16_to_f32, dequantize, f32_to_bf16, quantize


@kernel(GgmlOp.GET_ROWS, src=(*READABLE, I32), dst=(F32, I32))
def _get_rows(node: GraphTensor, mem: Memory) -> None:
    # dst[:, i10, i11, i12] = src0[:, idx[i10, i11, i12], i11, i12]
    a_t, i_t = src(node, 0), src(node, 1)
    need_types(node, a_t, (*READABLE, I32), "source 0")
    ne00, ne01, ne02, ne03 = (int(n) for n in a_t.ne)
    ne10, ne11, ne12, ne13 = (int(n) for n in i_t.ne)
    if ne13 != 1 or ne02 != ne11 or ne03 != ne12:
        raise node_error(node, "index tensor [n, a, b, 1] must match the rows' dims 2 and 3 [., ., a, b]")
    if tuple(node.ne) != (ne00, ne10, ne11, ne12):
        raise node_error(node, "result shape must be [src0.ne0, idx.ne0, idx.ne1, idx.ne2]")
    if node.type != (I32 if a_t.type == I32 else F32):
        raise node_error(node, "result type must be F32 (I32 for I32 rows)")
    idx = read_index(mem, node, i_t, ne01, "row index")[0]  # (ne12, ne11, ne10)
    raw = mem.raw(a_t)  # (ne03, ne02, ne01, ...)
    i3 = np.arange(ne12)[:, None, None]
    i2 = np.arange(ne11)[None, :, None]
    rows = raw[i3, i2, idx]  # only the rows asked for are read (and dequantised)
    if a_t.type == I32 or a_t.type == F32:
        vals = rows
    elif a_t.type in PLAIN_DTYPES:
        vals = bf16_to_f32(rows) if a_t.type == BF16 else rows.astype(np.float32)
    else:
        vals = dequantize(a_t.type, rows)
    np.copyto(mem.raw(node), vals, casting="unsafe")


@kernel(GgmlOp.SET_ROWS, src=(F32, F16), dst=WRITABLE, note="I32/I64 indices broadcast over dims 2 and 3")
def _set_rows(node: GraphTensor, mem: Memory) -> None:
    # dst[:, idx[i01, i02 % ne11, i03 % ne12], i02, i03] = src0[:, i01, i02, i03]
    a_t, i_t = src(node, 0), src(node, 1)
    need_types(node, a_t, (F32, F16), "source 0")
    ne00, ne01, ne02, ne03 = (int(n) for n in a_t.ne)
    ne10, ne11, ne12, ne13 = (int(n) for n in i_t.ne)
    if ne00 != node.ne[0] or ne02 != node.ne[2] or ne03 != node.ne[3]:
        raise node_error(node, "source rows must have the destination's dims 0, 2 and 3")
    if ne10 != ne01 or ne13 != 1 or ne11 == 0 or ne12 == 0 or ne02 % ne11 or ne03 % ne12:
        raise node_error(node, "index tensor must be [src0.ne1, divisor of src0.ne2, divisor of src0.ne3, 1]")
    if node.type not in WRITABLE:
        raise node_error(node, "destination type cannot be written")
    idx = read_index(mem, node, i_t, int(node.ne[1]), "row index")[0]  # (ne12, ne11, ne10)
    if a_t.ne[0] == 0 or ne01 == 0:
        return
    i3 = np.arange(ne03)[:, None]
    i2 = np.arange(ne02)[None, :]
    targets = idx[i3 % ne12, i2 % ne11]  # (ne03, ne02, ne01): the destination row of every source row
    # Convert the rows first, then scatter them whole (later duplicates win, as in ggml's in-order loop).
    rows = _convert_rows(node.type, a_t.type, mem.raw(a_t))
    mem.raw(node)[i3[:, :, None], i2[:, :, None], targets] = rows


def _convert_rows(type_id: int, src_type: int, raw: np.ndarray) -> np.ndarray:
    """Source rows (F32 or F16 raw values) in the destination type's element or block layout."""
    if type_id == src_type:
        return raw
    x = raw.astype(np.float32)
    if type_id == F32:
        return x
    if type_id == F16:
        return x.astype(np.float16)
    if type_id == BF16:
        return f32_to_bf16(x)
    return quantize(type_id, x)
