"""Fast layouts derived from the construct declarations.

Interpreted construct walks a Struct field by field, which is far too slow for bulk traffic, and compiled
construct takes shortcuts on corrupt input.  Every fixed-size Struct of the spec is therefore also turned, here
and only here, into:

* a :class:`FlatLayout`: one :mod:`struct` format (safe on any bytes of the exact length) and the recipe to turn
  the flat tuple back into the same nested dict shape construct produces;
* a numpy structured dtype with the same field names, offsets and sizes (for arrays of tensors).

Nothing here restates a field: a test proves the derived forms agree with construct on random bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from construct import Construct, Struct

from .schema_walk import classify, unwrap


def _field_kind(sub: Construct) -> tuple[str, Any]:
    """Classify one sub-construct: ('scalar', fmtchar) | ('array', (count, fmtchar)) | ('bytes', n) | ('struct', s)."""
    info = classify(sub)
    if info.variable:
        raise TypeError("only fixed-count arrays have a flat layout")
    if info.kind == "int":
        return "scalar", info.fmt
    if info.kind == "array":
        return "array", (info.count, info.fmt)
    if info.kind == "bytes":
        return "bytes", info.length
    if info.kind == "struct_array":
        return "struct_array", (info.count, info.struct)
    return "struct", info.struct


@dataclass(frozen=True)
class _Step:
    name: str
    kind: str
    width: int  # number of flat tuple items this field consumes
    nested: FlatLayout | None = None
    count: int = 0


class FlatLayout:
    """A fixed-size Struct as one ``struct.Struct`` plus the recipe to rebuild nested dicts."""

    def __init__(self, schema: Struct) -> None:
        self.schema = schema
        self._steps: list[_Step] = []
        fmt = ["<"]
        for sub in schema.subcons:
            kind, arg = _field_kind(sub)
            if kind == "scalar":
                fmt.append(arg)
                self._steps.append(_Step(sub.name, kind, 1))
            elif kind == "array":
                count, ch = arg
                fmt.append(f"{count}{ch}")
                self._steps.append(_Step(sub.name, kind, count))
            elif kind == "bytes":
                fmt.append(f"{arg}s")
                self._steps.append(_Step(sub.name, kind, 1))
            elif kind == "struct_array":
                count, inner = arg
                nested = flat_layout(inner)
                fmt.append(nested.struct.format[1:] * count)
                self._steps.append(_Step(sub.name, kind, nested.width * count, nested, count))
            else:
                nested = flat_layout(arg)
                fmt.append(nested.struct.format[1:])
                self._steps.append(_Step(sub.name, kind, nested.width, nested))
        self.struct = struct.Struct("".join(fmt))
        self.size = self.struct.size
        self.width = sum(s.width for s in self._steps)
        if self.size != schema.sizeof():
            raise AssertionError(f"derived size {self.size} != construct size {schema.sizeof()}")

    def _rebuild(self, flat: tuple, start: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        i = start
        for step in self._steps:
            if step.kind == "array":
                out[step.name] = list(flat[i : i + step.width])
            elif step.kind == "struct":
                assert step.nested is not None
                out[step.name] = step.nested._rebuild(flat, i)
            elif step.kind == "struct_array":
                assert step.nested is not None
                w = step.nested.width
                out[step.name] = [step.nested._rebuild(flat, i + k * w) for k in range(step.count)]
            else:
                out[step.name] = flat[i]
            i += step.width
        return out

    def unpack(self, buf: bytes | bytearray | memoryview, offset: int = 0) -> dict[str, Any]:
        """Parse exactly ``size`` bytes at ``offset`` into the nested dict construct would give."""
        return self._rebuild(self.struct.unpack_from(buf, offset), 0)

    def _flatten(self, value: dict[str, Any], out: list) -> None:
        for step in self._steps:
            v = value[step.name]
            if step.kind == "array":
                if len(v) != step.width:
                    raise ValueError(f"field {step.name!r} needs {step.width} items, got {len(v)}")
                out.extend(v)
            elif step.kind == "struct":
                assert step.nested is not None
                step.nested._flatten(v, out)
            elif step.kind == "struct_array":
                assert step.nested is not None
                if len(v) != step.count:
                    raise ValueError(f"field {step.name!r} needs {step.count} items, got {len(v)}")
                for item in v:
                    step.nested._flatten(item, out)
            else:
                out.append(v)

    def slots(self, start: int = 0, prefix: str = "") -> dict[str, tuple[int, int]]:
        """Where each field sits in the flat tuple of one ``struct.unpack``: dotted path -> (first index, width).

        Hot paths index that tuple instead of rebuilding nested dicts; nested Structs are listed both as a whole
        and field by field (``tensor`` and ``tensor.data``).
        """
        out: dict[str, tuple[int, int]] = {}
        i = start
        for step in self._steps:
            out[prefix + step.name] = (i, step.width)
            if step.kind == "struct" and step.nested is not None:
                out.update(step.nested.slots(i, f"{prefix}{step.name}."))
            i += step.width
        return out

    def pack(self, value: dict[str, Any]) -> bytes:
        """Build the bytes of a nested dict of this layout."""
        flat: list = []
        self._flatten(value, flat)
        return self.struct.pack(*flat)

    def pack_into(self, buf: bytearray | memoryview, offset: int, value: dict[str, Any]) -> None:
        flat: list = []
        self._flatten(value, flat)
        self.struct.pack_into(buf, offset, *flat)


_FLAT_CACHE: dict[int, FlatLayout] = {}


def flat_layout(schema: Struct) -> FlatLayout:
    """The (cached) flat layout of a fixed-size Struct."""
    key = id(schema)
    layout = _FLAT_CACHE.get(key)
    if layout is None:
        layout = _FLAT_CACHE[key] = FlatLayout(schema)
    return layout


def _np_scalar(ch: str) -> np.dtype:
    """numpy dtype of a standard-size struct format character ('l' is 4 bytes in struct, 8 in numpy)."""
    kind = "f" if ch in "efd" else ("i" if ch.islower() else "u")
    return np.dtype(f"<{kind}{struct.calcsize('<' + ch)}")


def numpy_dtype(schema: Struct) -> np.dtype:
    """A packed numpy structured dtype with the Struct's field names, offsets and sizes."""
    names, formats, offsets = [], [], []
    offset = 0
    for sub in schema.subcons:
        kind, arg = _field_kind(sub)
        if kind == "scalar":
            fmt: Any = _np_scalar(arg)
        elif kind == "array":
            count, ch = arg
            fmt = (_np_scalar(ch), (count,))
        elif kind == "bytes":
            fmt = np.dtype(("S", arg))
        elif kind == "struct_array":
            count, inner = arg
            fmt = (numpy_dtype(inner), (count,))
        else:
            fmt = numpy_dtype(arg)
        names.append(sub.name)
        formats.append(fmt)
        offsets.append(offset)
        offset += unwrap(sub)[0].sizeof()
    dt = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": offset})
    if dt.itemsize != schema.sizeof():
        raise AssertionError("derived dtype size disagrees with construct")
    return dt


def record_to_dict(record: np.void) -> dict[str, Any]:
    """One element of a structured array as the nested dict construct would give (names keep NUL padding)."""
    out: dict[str, Any] = {}
    for name in record.dtype.names:
        v = record[name]
        if isinstance(v, np.ndarray):
            out[name] = [int(x) for x in v]
        elif isinstance(v, bytes):
            out[name] = v.ljust(record.dtype[name].itemsize, b"\0")
        elif isinstance(v, np.void):
            out[name] = record_to_dict(v)
        else:
            out[name] = int(v)
    return out
