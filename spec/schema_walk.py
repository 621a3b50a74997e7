"""Reading the construct declarations back as data: what each field of a payload Struct is.

The generated reference (:mod:`ggml_rpc.spec.render.markdown`) and the hypothesis strategies
(:mod:`ggml_rpc.spec.strategies`) both walk the same Structs; this module is the one place that knows how
construct wraps a field (``"name" / Int64ul * "doc"`` is two nested ``Renamed``) and how a counted array names
its count field (``Array(this.n_nodes, ...)``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from construct import Array, Bytes, Construct, FormatField, Renamed, Struct


@dataclass(frozen=True)
class FieldInfo:
    """One field of a Struct, classified.

    ``kind`` is one of ``int`` (a FormatField), ``array`` (of ints), ``bytes``, ``struct`` or ``struct_array``.
    For arrays ``count`` is either a fixed int or the name of the earlier field that holds the count.
    """

    name: str
    kind: str
    doc: str
    sub: Construct
    fmt: str = ""  # struct format character of the (element) integer, e.g. "Q"
    count: int | str = 1
    length: int = 0  # bytes
    struct: Struct | None = None  # the nested Struct (struct / struct_array)

    @property
    def variable(self) -> bool:
        return isinstance(self.count, str)


def unwrap(sub: Construct) -> tuple[Construct, str]:
    """The construct under the ``Renamed`` layers of a field, and the field's doc string ('' if none)."""
    doc = ""
    while isinstance(sub, Renamed):
        doc = doc or (sub.docs or "")
        sub = sub.subcon
    return sub, doc


class _KeyRecorder(dict):
    """A context that records which key an expression such as ``this.n_nodes`` reads."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def __getitem__(self, key: str) -> int:
        self.keys.append(key)
        return 0

    __getattr__ = __getitem__


def count_field(array: Array) -> int | str:
    """An Array's count: the int itself, or the name of the sibling field the expression reads."""
    if isinstance(array.count, int):
        return array.count
    rec = _KeyRecorder()
    array.count(rec)
    if len(rec.keys) != 1:
        raise TypeError(f"array count {array.count!r} must read exactly one sibling field")
    return rec.keys[0]


def int_format(field: FormatField) -> str:
    """The struct format character of a little-endian integer FormatField."""
    if field.fmtstr[0] not in "<=" or field.fmtstr[1:] not in "bBhHiIlLqQ":
        raise TypeError(f"only little-endian integer fields are declared, got {field.fmtstr!r}")
    return field.fmtstr[1:]


def int_range(fmt: str) -> tuple[int, int]:
    """Inclusive value range of a struct integer format character."""
    bits = 8 * struct.calcsize("<" + fmt)
    if fmt.islower():
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def int_label(fmt: str) -> str:
    """``u64``, ``i32``, ... for a struct format character."""
    return f"{'i' if fmt.islower() else 'u'}{8 * struct.calcsize('<' + fmt)}"


def classify(sub: Construct) -> FieldInfo:
    """Classify one (named) sub-construct of a Struct."""
    name = sub.name or ""
    inner, doc = unwrap(sub)
    if isinstance(inner, FormatField):
        fmt = int_format(inner)
        return FieldInfo(name, "int", doc, inner, fmt=fmt, length=inner.sizeof())
    if isinstance(inner, Bytes):
        if not isinstance(inner.length, int):
            raise TypeError(f"field {name!r}: only fixed-length Bytes are declared")
        return FieldInfo(name, "bytes", doc, inner, length=inner.length)
    if isinstance(inner, Struct):
        return FieldInfo(name, "struct", doc, inner, length=inner.sizeof(), struct=inner)
    if isinstance(inner, Array):
        count = count_field(inner)
        elem, _ = unwrap(inner.subcon)
        if isinstance(elem, FormatField):
            fmt = int_format(elem)
            length = count * elem.sizeof() if isinstance(count, int) else 0
            return FieldInfo(name, "array", doc, inner, fmt=fmt, count=count, length=length)
        if isinstance(elem, Struct):
            length = count * elem.sizeof() if isinstance(count, int) else 0
            return FieldInfo(name, "struct_array", doc, inner, count=count, length=length, struct=elem)
    raise TypeError(f"field {name!r}: no walker for {type(inner).__name__}")


def fields(schema: Struct) -> list[FieldInfo]:
    """Every field of a Struct, in wire order."""
    return [classify(sub) for sub in schema.subcons]


def element_size(info: FieldInfo) -> int:
    """Bytes of one element of an array field (or of the whole field otherwise)."""
    if info.kind == "array":
        return struct.calcsize("<" + info.fmt)
    if info.kind == "struct_array":
        assert info.struct is not None
        return info.struct.sizeof()
    return info.length


def count_fields(schema: Struct) -> dict[str, str]:
    """Count field name -> name of the array it counts, for the variable arrays of a Struct."""
    return {f.count: f.name for f in fields(schema) if isinstance(f.count, str)}

