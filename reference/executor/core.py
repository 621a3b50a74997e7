"""The kernel registry, reading sources as float32 and writing results into a node's own memory.

A kernel is a function ``(node, mem) -> None`` registered for one ggml op.  Each registration also states which
types it takes (for the generated ops x types table), so the table cannot drift from the code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from ggml_rpc.spec import GgmlOp, type_name

from ..graph import ExecutorError, GraphTensor
from .grids import available
from .memory import BF16, F16, F32, PLAIN_DTYPES, Memory, node_error
from .types import (
    DEQUANT,
    QUANT,
    READ_QUANTS,
    WRITE_QUANTS,
    bf16_to_f32,
    dequantize,
    f32_to_bf16,
    quantize,
)

Kernel = Callable[[GraphTensor, Memory], None]
#: Prepares one node for repeated runs: a numpy call and its arguments (views made once), or None when the node
#: needs its kernel.  It may assume nothing beyond what it checks, and must agree with the kernel in every case.
Preparer = Callable[[GraphTensor, Memory], tuple[Callable[..., Any], tuple[Any, ...]] | None]

# READ_QUANTS / WRITE_QUANTS (the quantised types read and written) follow the dequantisers and quantisers in types.
FLOATS: tuple[int, ...] = (F32, F16, BF16)
READABLE: tuple[int, ...] = FLOATS + READ_QUANTS
WRITABLE: tuple[int, ...] = FLOATS + WRITE_QUANTS


@dataclass(frozen=True, slots=True)
class Support:
    """One row of the ops x types table: an op (or op/sub-op) and the types it takes."""

    op: str
    src_types: tuple[int, ...]
    dst_types: tuple[int, ...]
    note: str = ""


KERNELS: dict[int, Kernel] = {}
SUPPORT: list[Support] = []
#: Ops whose common cases run as one numpy call on views prepared in advance (see ``plan.py``).
PREPARED: dict[int, Preparer] = {}


def kernel(op: GgmlOp, *, src: Iterable[int], dst: Iterable[int], note: str = "") -> Callable[[Kernel], Kernel]:
    """Register ``fn`` as the kernel of ``op`` and record what it supports."""

    def wrap(fn: Kernel) -> Kernel:
        KERNELS[int(op)] = fn
        SUPPORT.append(Support(op.name, tuple(src), tuple(dst), note))
        return fn

    return wrap


def prepared(op: GgmlOp) -> Callable[[Preparer], Preparer]:
    """Register ``fn`` as the preparer of ``op``'s common cases."""

    def wrap(fn: Preparer) -> Preparer:
        PREPARED[int(op)] = fn
        return fn

    return wrap


def declare(label: str, *, src: Iterable[int], dst: Iterable[int], note: str = "") -> None:
    """Record a table row for a sub-op handled inside a registered kernel (UNARY, GLU)."""
    SUPPORT.append(Support(label, tuple(src), tuple(dst), note))


# ---- sources -----------------------------------------------------------------------------------------------------


def src(node: GraphTensor, i: int) -> GraphTensor:
    """Source ``i`` of ``node``, which the op requires."""
    s = node.src[i]
    if s is None:
        raise node_error(node, f"source {i} is missing")
    return s


def need_types(node: GraphTensor, t: GraphTensor, allowed: Iterable[int], role: str) -> None:
    if t.type not in allowed:
        raise node_error(node, f"{role} type {type_name(t.type)} is not supported here")
    if not available(t.type):
        # An IQ grid type is declared readable, but its codebook comes from an upstream build that is not there.
        raise node_error(node, f"{role} type {type_name(t.type)} needs the IQ codebooks of an installed upstream "
                               "build (`ggml-rpc upstream install`), and there is none")


def read(mem: Memory, t: GraphTensor) -> np.ndarray:
    """The tensor's values as float32, shape (ne3, ne2, ne1, ne0): the live view for F32, a converted copy else."""
    return convert(t.type, mem.raw(t))


def convert(ty: int, raw: np.ndarray) -> np.ndarray:
    """A tensor's raw view (see :meth:`Memory.raw`) as float32 values; F32 is returned as it is."""
    if ty == F32:
        return raw
    if ty == F16:
        return raw.astype(np.float32)
    if ty == BF16:
        return bf16_to_f32(raw)
    if ty in PLAIN_DTYPES:
        return raw.astype(np.float32)
    if ty in DEQUANT:
        return dequantize(ty, raw)
    raise ExecutorError(f"cannot read tensor of type {type_name(ty)}")


def read_index(mem: Memory, node: GraphTensor, t: GraphTensor, limit: int, what: str) -> np.ndarray:
    """An I32/I64 index tensor, every value checked to lie in ``[0, limit)``, as int64."""
    if t.type not in (26, 27):
        raise node_error(node, f"{what} must be I32 or I64, not {type_name(t.type)}")
    idx = mem.raw(t).astype(np.int64)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        bad = idx[(idx < 0) | (idx >= limit)].ravel()[0]
        raise node_error(node, f"{what} value {int(bad)} is outside [0, {limit})")
    return idx


def write(mem: Memory, t: GraphTensor, values: np.ndarray) -> None:
    """Store float values (broadcastable to the tensor's shape) into the tensor's memory, converting to its type."""
    raw = mem.raw(t)
    ty = t.type
    if ty == F32 or ty == F16 or (ty in PLAIN_DTYPES and ty != BF16):
        np.copyto(raw, values, casting="unsafe")
        return
    ne = t.ne
    full = np.broadcast_to(np.asarray(values, dtype=np.float32), (ne[3], ne[2], ne[1], ne[0]))
    if ty == BF16:
        raw[...] = f32_to_bf16(full)
    elif ty in QUANT:
        raw[...] = quantize(ty, full)
    else:
        raise ExecutorError(f"cannot write tensor of type {type_name(ty)}")


def same_shape(node: GraphTensor, t: GraphTensor, what: str = "source 0") -> None:
    if tuple(t.ne) != tuple(node.ne):
        raise node_error(node, f"{what} shape differs from the result's")


def nelements(t: GraphTensor) -> int:
    return int(t.ne[0]) * int(t.ne[1]) * int(t.ne[2]) * int(t.ne[3])


def can_repeat(small: GraphTensor, big: GraphTensor) -> bool:
    """ggml's rule: every dimension of ``big`` is a whole multiple of ``small``'s."""
    return all(s > 0 and b % s == 0 for s, b in zip(small.ne, big.ne, strict=True)) or nelements(big) == 0


def tile_to(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Repeat ``values`` (each dim dividing ``shape``) to ``shape``: a broadcast view when every dim is 1 or equal."""
    if values.shape == shape:
        return values
    if all(v in (1, s) for v, s in zip(values.shape, shape, strict=True)):
        return np.broadcast_to(values, shape)
    return np.tile(values, tuple(s // v for v, s in zip(values.shape, shape, strict=True)))


def params_f32(node: GraphTensor) -> np.ndarray:
    return np.asarray(node.op_params, dtype=np.int32).view(np.float32)


def params_i32(node: GraphTensor) -> np.ndarray:
    return np.asarray(node.op_params, dtype=np.int32)
