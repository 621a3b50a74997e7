"""A scratch buffer for building graphs by hand (tests, benchmarks, examples): tensors placed one after another
in one numpy-backed buffer, values written and read through the executor's own conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ggml_rpc.spec import TYPES, GgmlOp, TensorFlag, contiguous_strides

from ..graph import GraphTensor
from .core import read, write
from .memory import Memory

_ALIGN = 32


class Arena:
    """Tensors in one buffer of ``size`` bytes, laid out contiguously (32-byte aligned) in creation order."""

    def __init__(self, size: int) -> None:
        self.memory = np.zeros(size, dtype=np.uint8)
        self.view = memoryview(self.memory)
        self.used = 0
        self._next_id = 1

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def tensor(self, type_id: int, ne: Sequence[int], *, op: int = 0, src: Sequence[GraphTensor | None] = (),
               params: Sequence[int] | np.ndarray = (), name: str = "",
               nb: Sequence[int] | None = None) -> GraphTensor:
        """A new contiguous tensor (COMPUTE flag set when ``op`` is not NONE)."""
        dims = (*ne, *([1] * (4 - len(ne))))
        strides = tuple(nb) if nb is not None else tuple(contiguous_strides(type_id, dims))
        info = TYPES[type_id]
        size = (dims[0] // info.blck) * info.size * dims[1] * dims[2] * dims[3]
        offset = -(-self.used // _ALIGN) * _ALIGN
        if offset + size > self.memory.size:
            raise MemoryError("arena is full")
        self.used = offset + size
        return self._make(type_id, dims, strides, offset, op, src, params, name)

    def view_of(self, base: GraphTensor, ne: Sequence[int], nb: Sequence[int], offset: int = 0, *,
                op: int = int(GgmlOp.VIEW), name: str = "") -> GraphTensor:
        """A view of ``base`` (VIEW/PERMUTE/...): same memory, other shape and strides, ``offset`` bytes in."""
        dims = (*ne, *([1] * (4 - len(ne))))
        t = self._make(base.type, dims, tuple(nb), base.offset + offset, op, (base,), (), name)
        t.view_src = base
        t.view_offs = offset
        return t

    def _make(self, type_id: int, ne: tuple[int, ...], nb: tuple[int, ...], offset: int, op: int,
              src: Sequence[GraphTensor | None], params: Sequence[int] | np.ndarray, name: str) -> GraphTensor:
        op_params = np.zeros(16, dtype=np.int32)
        p = np.asarray(params)
        if p.size:
            op_params[: p.size] = p.view(np.int32) if p.dtype == np.float32 else p.astype(np.int32)
        sources: list[GraphTensor | None] = [*src, *([None] * (10 - len(src)))]
        return GraphTensor(
            id=self._id(), type=type_id, ne=ne, nb=nb, op=int(op), op_params=op_params,
            flags=int(TensorFlag.COMPUTE) if op else 0, src=sources, name=name,
            buffer=self.view, offset=offset, data=offset,
        )

    def set(self, t: GraphTensor, values: np.ndarray | float) -> None:
        """Store values (shape (ne3, ne2, ne1, ne0) or broadcastable) converted to the tensor's type."""
        write(Memory(), t, np.asarray(values, dtype=np.float32))

    def set_raw(self, t: GraphTensor, values: np.ndarray) -> None:
        """Store values of the tensor's own numpy dtype (integers for index tensors) without conversion."""
        Memory().raw(t)[...] = values

    def get(self, t: GraphTensor) -> np.ndarray:
        """The tensor's values as a float32 copy of shape (ne3, ne2, ne1, ne0)."""
        return np.array(read(Memory(), t), dtype=np.float32)

    def raw(self, t: GraphTensor) -> np.ndarray:
        """The tensor's memory as the executor sees it (a live view)."""
        return Memory().raw(t)


def params(*values: int | float) -> np.ndarray:
    """op_params from a mix of ints and floats (floats stored as their float32 bits)."""
    out = np.zeros(len(values), dtype=np.int32)
    for i, v in enumerate(values):
        out[i] = np.float32(v).view(np.int32) if isinstance(v, float) else int(v)
    return out
