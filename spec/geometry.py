"""Tensor geometry: how an rpc_tensor's shape and address lie relative to the buffers of a connection, as classes that
one generator draws from.

Every tensor any command carries -- SET/GET/MEMSET/COPY_TENSOR's, SET_TENSOR_HASH's, the 2-D transfers', INIT_TENSOR's,
GET_ALLOC_SIZE's and GET_DEVICE_SUPPORTS_OP's, the sources, destinations and views of a graph -- is described by the
same fields, so its geometry is drawn once, here, along three dimensions:

* **shape** (``ne``, ``nb``): contiguous; one element; empty in one dimension (``empty-0`` .. ``empty-3``: ggml_nbytes
  is then 0 whatever the other fields say); exactly one quantisation block per row (``block-edge``); rows padded
  apart (``padded``); dimensions swapped (``transposed``, non-contiguous); a stride of 0 (``broadcast``); rows that
  overlap (``overlapping``); a negative stride, which the 32-bit ``nb`` field carries as 2^32 - k (``negative-stride``:
  a huge span; ``negative-unit``: in a dimension of one element, where ggml_nbytes ignores it);
* **place** (``buffer``, ``data``): inside its buffer (aligned or not), at its first byte, ending at its last byte,
  below its base, across or past its end, inside another live buffer of the connection (with this buffer's handle),
  in a freed buffer, in no buffer (handle 0) or an unknown one;
* **view** (``view_src``, ``view_offs``, graph tensors): a view of another tensor at its start, inside it, ending at
  its end, or past it.

What this module may know: the rpc_tensor schema (how many dimensions, how wide ``ne`` and ``nb`` are), the type
table and ggml_nbytes. It must not know sockets, a server's state beyond the spans a caller passes (handle, base,
size), or whether a server accepts a geometry: that is the server's business, and a model's judgement.

Choices come from a :class:`Chooser` (``integer`` and ``choice``): a seeded PRNG (:class:`Seeded`) or the fuzzer's
draws, which shrink.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .enums import TYPES, GgmlType
from .facts import contiguous_strides, ggml_nbytes
from .schema_walk import fields as schema_fields
from .schema_walk import int_range
from .tensor import RpcTensor, make_tensor

T = TypeVar("T")

_FIELDS = {f.name: f for f in schema_fields(RpcTensor)}
#: Dimensions of a tensor, and the modulus of its ``nb`` field (a stride is 32 bits on the wire: -k is 2^32 - k).
DIMS: int = int(_FIELDS["ne"].count)
NB_MODULUS: int = int_range(_FIELDS["nb"].fmt)[1] + 1
NE_MAX: int = int_range(_FIELDS["ne"].fmt)[1]
_ADDRESS_MASK = int_range(_FIELDS["data"].fmt)[1]

#: The shape classes (``ne`` and ``nb``).
SHAPES: tuple[str, ...] = ("contiguous", "one-element", *(f"empty-{k}" for k in range(DIMS)), "block-edge", "padded",
                           "transposed", "broadcast", "overlapping", "negative-stride", "negative-unit")
#: The place classes (``buffer`` and ``data``).
PLACES: tuple[str, ...] = ("inside", "misaligned", "at-start", "at-end", "below", "across-end", "past-end",
                           "other-buffer", "freed-buffer", "null-buffer", "unknown-buffer")
#: The view classes of a graph tensor (``view_src`` and ``view_offs``).
VIEWS: tuple[str, ...] = ("view-start", "view-inside", "view-end", "view-past")
#: Places whose tensor lies wholly inside its own live buffer (when its bytes fit the buffer).
IN_BUFFER: frozenset[str] = frozenset({"inside", "misaligned", "at-start", "at-end"})
#: Shapes a server must take as they are (their span is what ggml_nbytes says, inside a few KiB).
ORDINARY_SHAPES: tuple[str, ...] = tuple(s for s in SHAPES if s != "negative-stride")

#: Types a geometry picks from by default: element types of every width and block-quantised ones.
DEFAULT_TYPES: tuple[int, ...] = tuple(int(GgmlType[n]) for n in ("F32", "F16", "BF16", "I8", "I16", "I32", "Q4_0",
                                                                   "Q8_0", "Q4_K"))
#: Largest span a drawn shape has (bytes), unless the caller asks for less.
MAX_SPAN = 4096


class Chooser(Protocol):
    """Where a generator's choices come from."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class Seeded:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, rng: random.Random | int) -> None:
        self.rng = rng if isinstance(rng, random.Random) else random.Random(rng)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


@dataclass(frozen=True, slots=True)
class Span:
    """A buffer as a client knows it: its handle, the base address BUFFER_GET_BASE gave and its size."""

    handle: int
    base: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass(slots=True)
class Geometry:
    """One drawn tensor: its rpc_tensor fields and the classes it was drawn from."""

    fields: dict[str, Any]
    shape: str
    place: str
    #: ggml_nbytes of the tensor (what every bounds check computes).
    nbytes: int
    #: The buffer the tensor was placed against (None: no buffer was given).
    span: Span | None
    view: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def klass(self) -> str:
        """The class, ``shape/place`` (and ``/view``)."""
        return "/".join(p for p in (self.shape, self.place, self.view) if p)

    @property
    def start(self) -> int | None:
        """Offset of the first byte from the span's base (negative: below it); None without a span."""
        if self.span is None:
            return None
        return self.fields["data"] - self.span.base

    @property
    def in_buffer(self) -> bool:
        """Does the tensor lie wholly inside its own live buffer (what a server must accept as a placement)?"""
        s = self.span
        if s is None or self.fields["buffer"] != s.handle:
            return False
        d = self.fields["data"]
        return s.base <= d and d + self.nbytes <= s.end

    def describe(self) -> str:
        f = self.fields
        name = TYPES[f["type"]].name if f["type"] in TYPES else str(f["type"])
        where = ""
        if self.span is not None:
            where = f", data = base {self._signed(self.start or 0)} of a {self.span.size}-byte buffer"
            if f["buffer"] != self.span.handle:
                where += f", buffer handle {f['buffer']:#x}"
        view = f", view of {f['view_src']:#x} at +{f['view_offs']}" if f.get("view_src") else ""
        nb = "(" + ", ".join(_stride(s) for s in f["nb"]) + ")"
        return (f"{name} ne=({', '.join(map(str, f['ne']))}) nb={nb} [{self.klass}], {self.nbytes} bytes"
                f"{where}{view}")

    @staticmethod
    def _signed(v: int) -> str:
        return f"- {-v}" if v < 0 else f"+ {v}"


def _stride(v: int) -> str:
    """A stride as the client meant it: values above 2^31 are negative strides carried in 32 bits."""
    return f"-{NB_MODULUS - v}" if v >= NB_MODULUS // 2 else str(v)


def _block_types(types: Sequence[int]) -> list[int]:
    return [t for t in types if TYPES[t].blck > 1]


def _element_types(types: Sequence[int]) -> list[int]:
    return [t for t in types if TYPES[t].blck == 1]


def draw_shape(c: Chooser, shape: str, *, types: Sequence[int] = DEFAULT_TYPES,
               max_span: int = MAX_SPAN) -> tuple[int, list[int], list[int]]:
    """(type, ne, nb) of a shape class whose span (ggml_nbytes) is at most ``max_span`` bytes (but for
    ``negative-stride``, whose span is the point)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape class {shape!r}")
    max_span = max(1, max_span)
    elements = _element_types(types) or [int(GgmlType.F32)]
    blocks = _block_types(types)
    if shape == "block-edge" and blocks:
        t = c.choice(blocks)
    elif shape in ("transposed", "broadcast", "overlapping", "one-element"):
        t = c.choice(elements)  # strides below one row need element types (a block's nb[0] is its size)
    else:
        t = c.choice(list(types))
    info = TYPES[t]
    unit = info.size  # bytes of one block (one element for element types)
    # Rows of whole blocks that fit the span (a tensor of at least one block).
    room = max(1, max_span // unit)
    if shape == "one-element":
        ne = [info.blck, 1, 1, 1]
        return t, ne, contiguous_strides(t, ne)
    if shape == "block-edge":
        rows = c.integer(1, max(1, min(4, room)))
        ne = [info.blck, rows, 1, 1]
        return t, ne, contiguous_strides(t, ne)
    rows = c.integer(1, max(1, min(4, room)))
    per_row = c.integer(1, max(1, min(16, room // rows)))
    ne = [per_row * info.blck, rows, 1, 1]
    if room // (rows * per_row) >= 2 and c.integer(0, 3) == 0:
        ne[2] = 2
    nb = contiguous_strides(t, ne)
    if shape == "contiguous":
        return t, ne, nb
    if shape.startswith("empty-"):
        k = int(shape.rsplit("-", 1)[1])
        ne[k] = 0
        return t, ne, nb
    if shape == "padded":
        ne[1] = max(2, ne[1])  # a stride matters only between two rows
        pad = unit * c.integer(1, 4)
        nb[1] = nb[1] + pad
        nb[2] = nb[1] * ne[1] + unit * c.integer(0, 2)
        nb[3] = nb[2] * ne[2]
        return _fit(t, ne, nb, max_span)
    if shape == "transposed":
        # ne = (a, b) stored column-major: element (i, j) at i*b*size + j*size.
        a, b = max(2, ne[0]), max(2, ne[1])
        ne = [a, b, 1, 1]
        nb = [unit * b, unit, unit * a * b, unit * a * b]
        return _fit(t, ne, nb, max_span)
    if shape == "broadcast":
        ne[1] = max(2, ne[1])
        nb[1] = 0
        nb[2] = nb[0] * ne[0]
        nb[3] = nb[2] * ne[2]
        return t, ne, nb
    if shape == "overlapping":
        ne[0], ne[1] = max(2, ne[0]), max(2, ne[1])
        nb[1] = unit  # each row starts one element after the one before
        nb[2] = nb[0] * (ne[0] + ne[1])
        nb[3] = nb[2] * ne[2]
        return _fit(t, ne, nb, max_span)
    if shape == "negative-stride":
        ne[1] = max(2, ne[1])
        nb[1] = NB_MODULUS - nb[1]
        return t, ne, nb
    # negative-unit: a negative stride in a dimension of one element (ggml_nbytes ignores it).
    k = c.integer(1, DIMS - 1)
    ne[k] = 1
    nb[k] = NB_MODULUS - max(unit, nb[k])
    return t, ne, nb


def _fit(t: int, ne: list[int], nb: list[int], max_span: int) -> tuple[int, list[int], list[int]]:
    """Drop planes, then rows, then blocks of each row, until the span fits ``max_span`` (a shape keeps its
    strides, and its two rows)."""
    blck = TYPES[t].blck
    while ggml_nbytes(t, ne, nb) > max_span and (ne[2] > 1 or ne[1] > 2 or ne[0] > blck):
        if ne[2] > 1:
            ne[2] = 1
        elif ne[1] > 2:
            ne[1] -= 1
        else:
            ne[0] -= blck
    return t, ne, nb


def _offsets(c: Chooser, low: int, high: int, alignment: int) -> int:
    """An offset in [low, high] on an ``alignment`` boundary (``low`` itself when none is)."""
    a = max(1, alignment)
    first = -(-low // a) * a
    if first > high:
        return low
    return first + a * c.integer(0, (high - first) // a)


def place(c: Chooser, type_id: int, ne: Sequence[int], nb: Sequence[int], span: Span, where: str, *, id: int,
          others: Sequence[Span] = (), freed: Sequence[Span] = (), alignment: int = 32, shape: str = "") -> Geometry:
    """The tensor of this type and shape placed against ``span`` as the place class ``where`` says.

    ``others`` are the connection's other live buffers, ``freed`` buffers it freed; a class that needs one when there
    is none falls back to its nearest kind (``past-end``; ``unknown-buffer``), and says so in the notes."""
    if where not in PLACES:
        raise ValueError(f"unknown place class {where!r}")
    nbytes = ggml_nbytes(type_id, ne, nb)
    handle, notes = span.handle, []
    size = span.size
    elem = TYPES[type_id].size
    if where in ("other-buffer",) and not others:
        where, notes = "past-end", ["no other live buffer: placed past the end instead"]
    if where == "freed-buffer" and not freed:
        where, notes = "unknown-buffer", ["no freed buffer: an unknown handle instead"]
    fits = nbytes <= size
    if where in IN_BUFFER and not fits:
        notes.append(f"{nbytes} bytes do not fit the {size}-byte buffer")
    last = max(0, size - nbytes)
    if where == "inside":
        offset = _offsets(c, 0, last, alignment)
    elif where == "misaligned":
        offset = min(last, _offsets(c, 0, last, alignment) + c.choice((1, 2, 3, max(1, elem - 1))))
    elif where == "at-start":
        offset = 0
    elif where == "at-end":
        offset = size - nbytes
    elif where == "below":
        # Just below, a few pages below (another allocation), or 2^44 below (nothing mapped there in a process).
        offset = -c.choice((1, elem, 32, 64, 4096, 1 << 44))
    elif where == "across-end":
        offset = size - nbytes + c.integer(1, max(1, min(nbytes, 64))) if nbytes else size + 1
    elif where == "past-end":
        offset = size + c.choice((0, 1, elem, 64, 4096))
    else:
        offset = 0
    data = span.base + offset
    if where == "other-buffer":
        other = c.choice(list(others))
        data = other.base + _offsets(c, 0, max(0, other.size - nbytes), alignment)
    elif where == "freed-buffer":
        gone = c.choice(list(freed))
        handle = gone.handle
        data = gone.base + _offsets(c, 0, max(0, gone.size - nbytes), alignment)
    elif where == "null-buffer":
        handle = 0
        data = c.choice((0, span.base))
    elif where == "unknown-buffer":
        known = {span.handle, *(o.handle for o in others), *(f.handle for f in freed)}
        handle = next(h for h in (0x4B1D_0000_0000_0001 + 2 * i for i in range(len(known) + 1)) if h not in known)
    fields = make_tensor(id=id, type=type_id, ne=tuple(ne), nb=tuple(nb), buffer=handle,
                         data=data & _ADDRESS_MASK, name=f"g{id}")
    return Geometry(fields, shape, where, nbytes, span, notes=notes)


def outside_addresses(span: Span, nbytes: int, *, others: Sequence[Span] = ()) -> list[int]:
    """Every address of the out-of-buffer place classes for a tensor of ``nbytes`` bytes named with ``span``'s
    handle: just, a few pages and 2^44 below the base, across the end, at and past the end, inside each of
    ``others`` (what a near-valid request puts in a tensor's ``data``)."""
    below = [span.base - k for k in (1, 32, 4096, 1 << 44)]
    across = [span.end - max(1, nbytes) + 1] if nbytes else []
    past = [span.end, span.end + 1, span.end + 4096]
    inside = [o.base + o.size // 2 for o in others if o.size]
    return [a & _ADDRESS_MASK for a in below + across + past + inside]


def draw_geometry(c: Chooser, span: Span, *, id: int, shape: str | None = None, where: str | None = None,
                  types: Sequence[int] = DEFAULT_TYPES, shapes: Sequence[str] = SHAPES,
                  places: Sequence[str] = PLACES, others: Sequence[Span] = (), freed: Sequence[Span] = (),
                  alignment: int = 32, max_span: int | None = None) -> Geometry:
    """A tensor of a shape class and a place class (drawn from ``shapes`` and ``places`` unless given) against
    ``span``; in-buffer places get shapes that fit the buffer."""
    where = where or c.choice(list(places))
    shape = shape or c.choice(list(shapes))
    limit = max_span if max_span is not None else MAX_SPAN
    if where in IN_BUFFER:
        limit = min(limit, span.size)
    t, ne, nb = draw_shape(c, shape, types=types, max_span=max(1, limit))
    return place(c, t, ne, nb, span, where, id=id, others=others, freed=freed, alignment=alignment, shape=shape)


def view_of(c: Chooser, base: Geometry, *, id: int, view: str | None = None) -> Geometry:
    """A view of ``base`` (a graph tensor): same buffer, ``view_src`` = base's id, ``view_offs`` from the view class,
    ``data`` = base's data + view_offs, and an element count that fits what is left of the base (none past it)."""
    view = view or c.choice(list(VIEWS))
    if view not in VIEWS:
        raise ValueError(f"unknown view class {view!r}")
    bf = base.fields
    t = bf["type"] if TYPES[bf["type"]].blck == 1 else int(GgmlType.F32)
    unit = TYPES[t].size
    total = max(0, base.nbytes)
    n = max(1, c.integer(1, max(1, total // unit // 2 or 1)))
    if view == "view-start":
        offs = 0
    elif view == "view-inside":
        offs = unit * c.integer(0, max(0, (total - n * unit) // unit))
    elif view == "view-end":
        offs = max(0, total - n * unit)
    else:
        offs = total + unit * c.integer(0, 4)
    ne = [n, 1, 1, 1]
    fields = make_tensor(id=id, type=t, ne=tuple(ne), buffer=bf["buffer"], data=(bf["data"] + offs) & _ADDRESS_MASK,
                         view_src=bf["id"], view_offs=offs, name=f"v{id}")
    return Geometry(fields, "contiguous", base.place, ggml_nbytes(t, ne, fields["nb"]), base.span, view=view)


def shape_class(type_id: int, ne: Sequence[int], nb: Sequence[int]) -> str:
    """The shape class of any ``ne``/``nb`` (the first that applies, in the order of :data:`SHAPES`' meaning)."""
    info = TYPES.get(type_id)
    if info is None or info.blck == 0:
        return "contiguous"
    ne, nb = list(ne), list(nb)
    for k, n in enumerate(ne):
        if n == 0:
            return f"empty-{k}"
    half = NB_MODULUS // 2
    if any(s >= half and n > 1 for s, n in zip(nb, ne, strict=True)):
        return "negative-stride"
    if any(s >= half for s in nb):
        return "negative-unit"
    if all(n == 1 for n in ne[1:]) and ne[0] == info.blck:
        return "one-element" if info.blck == 1 else "block-edge"
    if any(s == 0 and n > 1 for s, n in zip(nb, ne, strict=True)):
        return "broadcast"
    if list(nb) == contiguous_strides(type_id, ne) or all(
            s == c for s, c, n in zip(nb, contiguous_strides(type_id, ne), ne, strict=True) if n > 1):
        return "block-edge" if info.blck > 1 and ne[0] == info.blck else "contiguous"
    row = info.size * (ne[0] // info.blck)
    if ne[1] > 1 and nb[0] > nb[1]:
        return "transposed"
    if ne[1] > 1 and nb[1] < row:
        return "overlapping"
    return "padded"


def place_class(fields: Mapping[str, Any], nbytes: int, span: Span | None, *, alignment: int = 32) -> str:
    """The place class of a tensor's ``buffer``/``data`` against ``span``, the buffer its handle names (None: the
    handle names no live buffer)."""
    if not fields["buffer"]:
        return "null-buffer"
    if span is None:
        return "unknown-buffer"
    d = fields["data"]
    if d < span.base:
        return "below"
    if d >= span.end and not (d == span.end and nbytes == 0):
        return "past-end"
    if d + nbytes > span.end:
        return "across-end"
    if d == span.base:
        return "at-start"
    if d + nbytes == span.end:
        return "at-end"
    return "inside" if (d - span.base) % max(1, alignment) == 0 else "misaligned"


def classify(fields: Mapping[str, Any], span: Span | None, *, alignment: int = 32) -> Geometry:
    """Any rpc_tensor as a :class:`Geometry` (its classes found, not drawn): how findings name a tensor's geometry."""
    t = int(fields["type"])
    try:
        nbytes = ggml_nbytes(t, list(fields["ne"]), list(fields["nb"]))
    except (KeyError, ValueError):
        nbytes = 0
    shape = shape_class(t, fields["ne"], fields["nb"])
    view = "view" if fields.get("view_src") else None
    return Geometry(dict(fields), shape, place_class(fields, nbytes, span, alignment=alignment), nbytes, span,
                    view=view)


__all__ = ["DEFAULT_TYPES", "DIMS", "IN_BUFFER", "MAX_SPAN", "NB_MODULUS", "NE_MAX", "ORDINARY_SHAPES", "PLACES",
           "SHAPES", "VIEWS", "Chooser", "Geometry", "Seeded", "Span", "classify", "draw_geometry", "draw_shape",
           "outside_addresses", "place", "place_class", "shape_class", "view_of"]
