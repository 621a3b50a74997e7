"""Row normalisations: NORM, RMS_NORM, L2_NORM and GROUP_NORM (sums in double, as ggml does)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_f32, params_i32, prepared, read, same_shape, src, write
from .memory import F32, Memory, node_error


def _input(node: GraphTensor, mem: Memory) -> np.ndarray:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    same_shape(node, a_t)
    return read(mem, a_t)


@kernel(GgmlOp.RMS_NORM, src=FLOATS, dst=(F32,))
def _rms_norm(node: GraphTensor, mem: Memory) -> None:
    # Any layout and F16 sources through a float32 copy; the arithmetic is the compiled rms_norm_rows, as in a
    # prepared graph.
    from .row_kernels import rms_norm_rows

    x = np.ascontiguousarray(_input(node, mem), dtype=np.float32)
    out = np.empty_like(x)
    if x.size:
        n = x.shape[-1]
        rms_norm_rows(x.reshape(-1, n), float(params_f32(node)[0]), out.reshape(-1, n))
    write(mem, node, out)


@prepared(GgmlOp.RMS_NORM)
def _prepare_rms_norm(node: GraphTensor, mem: Memory) -> tuple[Callable[..., None], tuple] | None:
    """An F32 RMS_NORM over contiguous rows as one compiled call on views made once (the kernel's numpy form took
    9 us a row of 256, most of a decoding step's norms)."""
    a_t = src(node, 0)
    if a_t.type != F32 or node.type != F32 or tuple(a_t.ne) != tuple(node.ne) or not a_t.ne[0]:
        return None
    x, out = mem.raw(a_t), mem.raw(node)
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    if np.may_share_memory(x, out) and x.__array_interface__["data"][0] != out.__array_interface__["data"][0]:
        return None  # a shifted overlap: the kernel's temporary keeps it right
    from .row_kernels import rms_norm_rows

    n = x.shape[-1]
    return rms_norm_rows, (x.reshape(-1, n), float(params_f32(node)[0]), out.reshape(-1, n))


@kernel(GgmlOp.NORM, src=FLOATS, dst=(F32,))
def _norm(node: GraphTensor, mem: Memory) -> None:
    x = _input(node, mem)
    eps = params_f32(node)[0]
    n = max(x.shape[-1], 1)
    mean = (x.sum(axis=-1, keepdims=True, dtype=np.float64) / n).astype(np.float32)
    centred = x - mean
    var = (np.square(centred, dtype=np.float64).sum(axis=-1, keepdims=True) / n).astype(np.float32)
    write(mem, node, centred * (np.float32(1) / np.sqrt(var + eps)))


@kernel(GgmlOp.L2_NORM, src=FLOATS, dst=(F32,))
def _l2_norm(node: GraphTensor, mem: Memory) -> None:
    x = _input(node, mem)
    eps = params_f32(node)[0]
    norm = np.sqrt(np.square(x, dtype=np.float64).sum(axis=-1, keepdims=True)).astype(np.float32)
    write(mem, node, x * (np.float32(1) / np.maximum(norm, eps)))


@kernel(GgmlOp.GROUP_NORM, src=FLOATS, dst=(F32,))
def _group_norm(node: GraphTensor, mem: Memory) -> None:
    x = _input(node, mem)  # (ne3, ne2 channels, ne1, ne0)
    n_groups = int(params_i32(node)[0])
    eps = params_f32(node)[1]
    channels = x.shape[1]
    if n_groups <= 0:
        raise node_error(node, f"group count {n_groups} must be positive")
    per = (channels + n_groups - 1) // n_groups  # ggml's group size: the last group may be shorter
    out = np.empty_like(x)
    for start in range(0, channels, per):
        g = x[:, start : start + per]
        n = g[0].size or 1
        mean = (g.sum(axis=(1, 2, 3), keepdims=True, dtype=np.float64) / n).astype(np.float32)
        c = g - mean
        var = (np.square(c, dtype=np.float64).sum(axis=(1, 2, 3), keepdims=True) / n).astype(np.float32)
        out[:, start : start + per] = c * (np.float32(1) / np.sqrt(var + eps))
    write(mem, node, out)
