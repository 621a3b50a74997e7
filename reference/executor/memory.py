"""Strided numpy views over server buffer memory, checked before anything is touched.

A tensor of a plain type (F32, F16, BF16, I8..I64, F64) is seen as an array of shape ``(ne3, ne2, ne1, ne0)``
whose strides are the tensor's ``nb`` (reversed): no copy, so writes land in the buffer and views of the same
bytes see them.  A quantised tensor is seen as raw blocks, shape ``(ne3, ne2, ne1, ne0 / blck, type_size)`` of
uint8.  Every view is bounds-checked against its buffer with the tensor's real extent (computed from ``ne`` and
``nb`` here, not from the size the client claims), so a dimension of size 1 with a wild stride cannot escape.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import overload

import numpy as np
from ggml_rpc.spec import TYPES, GgmlType, op_name, type_name

from ..graph import ExecutorError, GraphTensor
from .builds import DEFAULT_BUILD, Build

F32 = int(GgmlType.F32)
F16 = int(GgmlType.F16)
BF16 = int(GgmlType.BF16)
I8 = int(GgmlType.I8)
I16 = int(GgmlType.I16)
I32 = int(GgmlType.I32)
I64 = int(GgmlType.I64)
F64 = int(GgmlType.F64)

#: Plain (one element per block) types and the numpy dtype their bytes are read with; BF16 is read as raw u16.
PLAIN_DTYPES: dict[int, np.dtype] = {
    F32: np.dtype("<f4"),
    F16: np.dtype("<f2"),
    BF16: np.dtype("<u2"),
    I8: np.dtype("i1"),
    I16: np.dtype("<i2"),
    I32: np.dtype("<i4"),
    I64: np.dtype("<i8"),
    F64: np.dtype("<f8"),
}
FLOAT_TYPES = frozenset({F32, F16, BF16})
# A view may alias itself (ggml allows any strides), but not claim more than this multiple of its buffer's bytes.
_OVERLAP_FACTOR = 4
_OVERLAP_SLACK = 1 << 26
INT_TYPES = frozenset({I8, I16, I32, I64})


def describe(t: GraphTensor | None) -> str:
    """``name TYPE[ne0,ne1,ne2,ne3]`` for error messages."""
    if t is None:
        return "<missing>"
    ne = ",".join(str(int(n)) for n in t.ne)
    label = t.name or f"id={t.id:#x}"
    return f"{label} {type_name(t.type)}[{ne}]"


def node_error(node: GraphTensor, why: str) -> ExecutorError:
    """An ExecutorError naming the op, the node and its sources (types and shapes) and the reason."""
    srcs = ", ".join(describe(s) for s in node.src if s is not None)
    return ExecutorError(f"{op_name(node.op)}: {why} (dst {describe(node)}; src {srcs or 'none'})")


def extent(t: GraphTensor) -> int:
    """Bytes from the tensor's first byte to one past its last, as its ne/nb really reach (0 when empty)."""
    ne = t.ne
    if ne[0] <= 0 or ne[1] <= 0 or ne[2] <= 0 or ne[3] <= 0:
        return 0
    info = TYPES.get(t.type)
    if info is None or info.blck == 0:
        raise ExecutorError(f"tensor {describe(t)}: unknown or removed type {t.type}")
    nb = t.nb
    span = (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]
    if info.blck == 1:
        return span + (ne[0] - 1) * nb[0] + info.size
    if ne[0] % info.blck:
        raise ExecutorError(f"tensor {describe(t)}: ne0 is not a multiple of the block size {info.blck}")
    if nb[0] != info.size:
        raise ExecutorError(f"tensor {describe(t)}: nb0 {nb[0]} is not the block size in bytes {info.size}")
    return span + (ne[0] // info.blck) * info.size


def buffer_key(buffer: object) -> int:
    """Who owns a tensor's memory: the object under its memoryview (each graph build makes new memoryviews of the
    same server buffer), as :meth:`Memory.converted` and the server's write epochs name a buffer."""
    return id(getattr(buffer, "obj", buffer))


#: Bytes of float32 copies of weights the process keeps (see :meth:`Memory.converted`).
CONVERTED_BUDGET = 512 << 20

_ConversionKey = tuple[int, int, int, tuple[int, ...], tuple[int, ...], str]


class Conversions:
    """float32 copies of weights, shared by every plan of the process, least recently used dropped first.

    A copy is named by the buffer array it was read from (held weakly: when the buffer is freed, its copies go
    with it, before its id can name another buffer) and the tensor's type, offset, ne and nb, so the plan of a new
    graph (a decoding step after the prompt's) finds the weights the previous graph converted.  Each copy carries
    the write epoch its buffer had; a copy is used only for the same epoch.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[_ConversionKey, tuple[int, np.ndarray]] = OrderedDict()
        self._owners: dict[int, weakref.ref] = {}
        self._room = budget
        # Re-entrant: a buffer freed by a collection that runs inside put() calls _forget() on the same thread.
        self._lock = threading.RLock()

    @staticmethod
    def key(owner: object, t: GraphTensor, kind: str = "") -> _ConversionKey:
        return (id(owner), int(t.type), int(t.offset), tuple(t.ne), tuple(t.nb), kind)

    def get(self, key: _ConversionKey, epoch: int) -> np.ndarray | None:
        with self._lock:
            kept = self._entries.get(key)
            if kept is None or kept[0] != epoch:
                return None
            self._entries.move_to_end(key)
            return kept[1]

    def put(self, owner: object, key: _ConversionKey, epoch: int, values: np.ndarray) -> None:
        if values.nbytes > self.budget:
            return
        with self._lock:
            if key[0] not in self._owners:
                try:
                    self._owners[key[0]] = weakref.ref(owner, lambda _ref, oid=key[0]: self._forget(oid))
                except TypeError:  # memory that cannot be watched is never kept: its id could be reused
                    return
            old = self._entries.pop(key, None)
            if old is not None:
                self._room += old[1].nbytes
            while self._room < values.nbytes and self._entries:
                self._room += self._entries.popitem(last=False)[1][1].nbytes
            values.flags.writeable = False  # shared between runs and plans: no kernel may write into it
            self._entries[key] = (epoch, values)
            self._room -= values.nbytes

    def _forget(self, owner_id: int) -> None:
        with self._lock:
            self._owners.pop(owner_id, None)
            for key in [k for k in self._entries if k[0] == owner_id]:
                self._room += self._entries.pop(key)[1].nbytes

    def room_for(self, key: _ConversionKey) -> int:
        """Bytes that can be kept under ``key`` without dropping another conversion (an entry under ``key`` itself,
        of an older epoch, would be replaced)."""
        with self._lock:
            old = self._entries.get(key)
            return self._room + (old[1].nbytes if old is not None else 0)

    @property
    def room(self) -> int:
        """Bytes that can be kept now without dropping a kept conversion."""
        return self._room

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self.budget - self._room

    def __len__(self) -> int:
        return len(self._entries)


#: The process's weight conversions.
CONVERSIONS = Conversions(CONVERTED_BUDGET)


class Memory:
    """Views of the tensors of one graph run, built once per tensor (a source used by many nodes costs one view).

    Its :meth:`converted` keeps float32 conversions of quantised or half-precision weights between runs and between
    plans (in :data:`CONVERSIONS`), but only when the run is told each buffer's write epoch (the server does: every
    write into a buffer outside a graph run bumps it) and only for buffers no node of the graph writes; a
    conversion is used again only while its buffer's epoch is unchanged, so a weight rewritten by SET_TENSOR, a
    hash hit, MEMSET, CLEAR or COPY is converted anew.
    """

    __slots__ = ("_bases", "_sealed", "_views", "build", "epochs", "written")

    def __init__(self, build: Build = DEFAULT_BUILD) -> None:
        #: The upstream build whose arithmetic the kernels reproduce where builds differ.
        self.build = build
        self._views: dict[GraphTensor, np.ndarray] = {}
        self._bases: dict[int, np.ndarray] = {}
        #: How many views and bases a plan made while preparing (None: not a plan's memory).
        self._sealed: tuple[int, int] | None = None
        #: Write epochs of the buffers for this run, by :func:`buffer_key` (None: keep no conversions).
        self.epochs: Mapping[int, int] | None = None
        #: :func:`buffer_key` of the buffers the graph's nodes write (their contents change during a run).
        self.written: frozenset[int] = frozenset()

    @overload
    def converted(self, t: GraphTensor, convert: Callable[[np.ndarray], np.ndarray], kind: str = "") -> np.ndarray:
        ...

    @overload
    def converted(self, t: GraphTensor, convert: Callable[[np.ndarray], np.ndarray], kind: str = "", *,
                  size: int) -> np.ndarray | None:
        ...

    def converted(self, t: GraphTensor, convert: Callable[[np.ndarray], np.ndarray], kind: str = "", *,
                  size: int | None = None) -> np.ndarray | None:
        """``t``'s values as float32, ``convert(self.raw(t))``, kept in :data:`CONVERSIONS` and reused while ``t``'s
        buffer is not written (see the class).  ``convert`` must give exactly that: the float32 values of ``t``; or,
        under its own ``kind``, another form of them that depends on ``t``'s bytes alone.

        With ``size`` (the bytes ``convert`` makes), for a caller that can compute from the raw bytes as well: None
        instead of a conversion that would not be kept, or only by dropping others (weights larger than the cache
        would otherwise be converted anew every graph, each conversion pushing out the next one needed)."""
        raw = self.raw(t)
        epochs = self.epochs
        owner = getattr(t.buffer, "obj", t.buffer)
        key = id(owner)
        epoch = epochs.get(key) if epochs is not None and key not in self.written else None
        if epoch is None:
            return convert(raw) if size is None else None
        name = Conversions.key(owner, t, kind)
        kept = CONVERSIONS.get(name, epoch)
        if kept is not None:
            return kept
        if size is not None and size > CONVERSIONS.room_for(name):
            return None
        values = convert(raw)
        if values is not raw:
            CONVERSIONS.put(owner, name, epoch, values)
        return values

    def _base(self, t: GraphTensor) -> np.ndarray:
        buf = t.buffer
        if buf is None:
            raise ExecutorError(f"tensor {describe(t)} has no server memory (no buffer)")
        key = id(buf)
        base = self._bases.get(key)
        if base is None:
            base = np.frombuffer(buf, dtype=np.uint8)
            self._bases[key] = base
        return base

    def seal(self) -> None:
        """Mark the views made so far as the plan's own: :meth:`unseal_run` drops any made after this."""
        self._sealed = (len(self._views), len(self._bases))

    def unseal_run(self) -> None:
        """Drop the views and bases made since :meth:`seal` (the newest ones: dicts keep insertion order)."""
        if self._sealed is None:
            return
        for store, keep in ((self._views, self._sealed[0]), (self._bases, self._sealed[1])):
            extra = len(store) - keep
            if extra > 0:
                for key in list(itertools.islice(reversed(store), extra)):
                    del store[key]

    def raw(self, t: GraphTensor) -> np.ndarray:
        """The tensor's bytes as a strided array (plain types: typed; quantised: uint8 blocks)."""
        v = self._views.get(t)
        if v is not None:
            return v
        return self._build(t)

    def _build(self, t: GraphTensor) -> np.ndarray:
        base = self._bases.get(id(t.buffer))
        if base is None:
            base = self._base(t)
        ne, nb = t.ne, t.nb
        dt = PLAIN_DTYPES.get(t.type)
        ne0, ne1, ne2, ne3 = ne
        if dt is not None and ne0 > 0 and ne1 > 0 and ne2 > 0 and ne3 > 0:
            # The common case (a non-empty plain tensor), with the same checks as below written out for speed.
            nb0, nb1, nb2, nb3 = nb
            itemsize = dt.itemsize
            off = t.offset
            end = off + (ne0 - 1) * nb0 + (ne1 - 1) * nb1 + (ne2 - 1) * nb2 + (ne3 - 1) * nb3 + itemsize
            limit = base.size
            room = _OVERLAP_FACTOR * limit + _OVERLAP_SLACK
            if off >= 0 and end <= limit and ne0 * ne1 * ne2 * ne3 * itemsize <= room:
                v = np.ndarray((ne3, ne2, ne1, ne0), dt, base, off, (nb3, nb2, nb1, nb0))
                self._views[t] = v
                return v
        if dt is not None and ne[0] > 0 and ne[1] > 0 and ne[2] > 0 and ne[3] > 0:
            size = (ne[0] - 1) * nb[0] + (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3] + dt.itemsize
        else:
            size = extent(t)
        off = t.offset
        if off < 0 or off + size > base.size:
            raise ExecutorError(
                f"tensor {describe(t)}: bytes [{off}, {off + size}) fall outside its buffer of {base.size} bytes"
            )
        # Overlapping (or zero) strides can make a small region claim a huge element count; anything an op would
        # allocate from it must stay proportionate to real memory.
        elements = ne[0] * ne[1] * ne[2] * ne[3]
        itemsize = dt.itemsize if dt is not None else TYPES[t.type].size / TYPES[t.type].blck
        if elements * itemsize > _OVERLAP_FACTOR * base.size + _OVERLAP_SLACK:
            raise ExecutorError(
                f"tensor {describe(t)}: {elements} elements in a buffer of {base.size} bytes (overlapping strides)"
            )
        if dt is not None:
            if size == 0:
                v = np.zeros((ne[3], ne[2], ne[1], ne[0]), dtype=dt)
            else:
                v = np.ndarray((ne[3], ne[2], ne[1], ne[0]), dt, base, off, (nb[3], nb[2], nb[1], nb[0]))
        else:
            info = TYPES[t.type]
            shape = (ne[3], ne[2], ne[1], ne[0] // info.blck, info.size)
            if size == 0:
                v = np.zeros(shape, dtype=np.uint8)
            else:
                v = np.ndarray(shape, np.uint8, base, off, (nb[3], nb[2], nb[1], info.size, 1))
        self._views[t] = v
        return v


def shape4(t: GraphTensor) -> tuple[int, int, int, int]:
    """The numpy shape of a tensor: ``(ne3, ne2, ne1, ne0)``."""
    ne = t.ne
    return (ne[3], ne[2], ne[1], ne[0])
