"""The spec's payload Structs as the flat tables the generated dissector's Lua walker interprets.

:class:`LayoutBuilder` walks a payload's construct Struct once and collects one :class:`LuaField` per distinct
field (its ProtoField) and one :class:`Layout` per Struct (kind, size, fixed or ``this.<field>`` count of each
element); :mod:`.lua_source` writes them out as Lua.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from construct import Construct, Struct

from .. import schema_walk
from ..messages import Payload, Shape
from ..tensor import RpcTensor

PROTO_NAME = "ggml_rpc"

#: Nested Structs get a field prefix of their own; any other nested Struct is prefixed by its field name.
STRUCT_PREFIXES: dict[int, str] = {id(RpcTensor): "tensor"}

#: Byte fields shown as text rather than hex (a presentation choice, like generate.HEX_FIELDS).
STRING_FIELDS = frozenset({"name"})


class GeneratorError(Exception):
    """The spec holds something the generator cannot express (a field kind it does not know, a name clash)."""


@dataclass
class LuaField:
    """One ProtoField of the generated dissector."""

    abbr: str
    label: str
    kind: str  # a key of generate._LUA_FIELD_TYPES or "none" (subtree of a nested Struct)
    doc: str
    values: str | None = None  # name of a value-string table
    var: str = ""


@dataclass
class LayoutElem:
    """One element of a generated layout table."""

    name: str
    kind: str  # scalar kind, "bytes", "string" or "struct"
    size: int  # bytes of one item (for "struct": the Struct's size)
    field: LuaField
    count: int | None = None
    count_from: str | None = None
    layout: int | None = None  # index of the nested layout for "struct"
    values: str | None = None


@dataclass
class Layout:
    index: int
    size: int | None  # None when it holds a variable-count array
    elems: list[LayoutElem] = field(default_factory=list)
    prefix: str = ""
    is_tensor: bool = False


class LayoutBuilder:
    """Collects fields and layouts while walking the spec's Structs."""

    def __init__(self, value_fields: Mapping[str, str]) -> None:
        self.fields: dict[str, LuaField] = {}
        self.layouts: list[Layout] = []
        self._layout_of: dict[int, int] = {}
        self.value_fields = value_fields
        self.payloads: list[PayloadEntry] = []
        self._payload_of: dict[int, int] = {}

    def payload(self, p: Payload, request: Payload | None = None) -> int:
        """Index of the PAYLOADS entry for one payload (built once per Payload object)."""
        key = id(p)
        if key not in self._payload_of:
            length: tuple[tuple[int, int], ...] = ()
            if p.shape is Shape.RAW:
                if request is None or not p.length_from:
                    raise GeneratorError("a RAW reply needs the request fields that give its length")
                length = tuple((offset_of(request.schema, name), width_of(request.schema, name))
                               for name in p.length_from)
            self.payloads.append(PayloadEntry(p.shape.name, self.layout(p.schema, ""), p.header_size, length))
            self._payload_of[key] = len(self.payloads)
        return self._payload_of[key]

    def add_field(self, abbr: str, label: str, kind: str, doc: str, values: str | None = None) -> LuaField:
        existing = self.fields.get(abbr)
        if existing is not None:
            if existing.kind != kind or existing.values != values:
                raise GeneratorError(f"field {abbr} is declared as {existing.kind} and as {kind}")
            return existing
        f = LuaField(abbr, label, kind, doc, values, f"F[{len(self.fields) + 1}]")
        self.fields[abbr] = f
        return f

    def layout(self, schema: Struct, prefix: str) -> int:
        """Index of the layout table for ``schema`` (built once per Struct object)."""
        key = id(schema)
        if key in self._layout_of:
            return self._layout_of[key]
        lay = Layout(len(self.layouts) + 1, None, prefix=prefix, is_tensor=tensor_like(schema))
        self.layouts.append(lay)
        self._layout_of[key] = lay.index
        fixed = True
        for sub in schema.subcons:
            elem = self._elem(sub, prefix)
            if elem.count_from is not None:
                fixed = False
            lay.elems.append(elem)
        if fixed:
            lay.size = schema.sizeof()
        return lay.index

    def _elem(self, sub: Construct, prefix: str) -> LayoutElem:
        name = sub.name
        if not name:
            raise GeneratorError("every field of a payload Struct needs a name")
        try:
            info = schema_walk.classify(sub)
        except TypeError as e:
            raise GeneratorError(f"field {name}: {e}") from e
        count: int | None = None
        count_from: str | None = None
        if info.kind in ("array", "struct_array"):
            if info.variable:
                count_from = str(info.count)
            else:
                count = int(info.count)
            if not info.doc:
                # The doc may sit on the element rather than on the array.
                _, elem_doc = schema_walk.unwrap(info.sub.subcon)
                info = replace(info, doc=elem_doc)
        doc = info.doc
        abbr_base = f"{PROTO_NAME}.{prefix + '.' if prefix else ''}{name}"
        if info.struct is not None:
            inner = info.struct
            sub_prefix = STRUCT_PREFIXES.get(id(inner), name)
            index = self.layout(inner, sub_prefix)
            # The subtree field describes the Struct itself (its own doc), not one use of it.
            struct_doc = vars(inner).get("__doc__") or doc
            f = self.add_field(f"{PROTO_NAME}.{sub_prefix}", sub_prefix, "none", struct_doc)
            size = self.layouts[index - 1].size
            if size is None:
                raise GeneratorError(f"nested Struct {name} must have a fixed size")
            return LayoutElem(name, "struct", size, f, count, count_from, index)
        if info.kind == "bytes":
            kind = "string" if name in STRING_FIELDS else "bytes"
            f = self.add_field(abbr_base, name, kind, doc)
            return LayoutElem(name, kind, info.length, f, count, count_from)
        kind = schema_walk.int_label(info.fmt)
        values = self.value_fields.get(abbr_base)
        f = self.add_field(abbr_base, name, kind, doc, values)
        return LayoutElem(name, kind, schema_walk.element_size(info), f, count, count_from, values=values)


#: Fields that make a Struct a tensor description: shown with its name, shape, nbytes and sub-op names.
TENSOR_FIELDS = frozenset({"id", "type", "ne", "nb", "op", "op_params", "name"})


def tensor_like(schema: Struct) -> bool:
    return TENSOR_FIELDS <= {sub.name for sub in schema.subcons}


def offset_of(schema: Struct, name: str) -> int:
    """Byte offset of a top-level fixed-size field."""
    pos = 0
    for sub in schema.subcons:
        if sub.name == name:
            return pos
        pos += sub.sizeof()
    raise GeneratorError(f"no field {name} in the Struct")


def width_of(schema: Struct, name: str) -> int:
    """Byte width of a top-level fixed-size field."""
    for sub in schema.subcons:
        if sub.name == name:
            return sub.sizeof()
    raise GeneratorError(f"no field {name} in the Struct")


@dataclass(frozen=True)
class PayloadEntry:
    shape: str
    layout: int
    size: int
    #: RAW replies: (offset, width) of each request field whose product is the reply's length.
    length_from: tuple[tuple[int, int], ...] = ()
