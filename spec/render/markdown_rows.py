"""Field tables of the protocol reference: a payload's construct Struct walked into rows of offset, size, type,
name and meaning (offsets that depend on counts written as ``const + n·field``), and the Markdown cells they
become (see :mod:`~ggml_rpc.spec.render.markdown`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from construct import Struct

from ..messages import Payload, Shape
from ..schema_walk import FieldInfo, element_size, fields, int_label
from ..tensor import RpcTensor

#: Named Structs get their own table and are linked, not expanded, where they appear inside a payload.
NAMED_STRUCTS: dict[int, tuple[str, str]] = {id(RpcTensor): ("rpc_tensor", "rpc_tensor")}


# ---- field rows --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Offset:
    """A byte offset that may depend on counts: ``const + sum(coef * count_field)``."""

    const: int = 0
    terms: tuple[tuple[str, int], ...] = ()

    def plus(self, const: int = 0, term: tuple[str, int] | None = None) -> Offset:
        terms = dict(self.terms)
        if term is not None:
            terms[term[0]] = terms.get(term[0], 0) + term[1]
        return Offset(self.const + const, tuple(terms.items()))

    def __str__(self) -> str:
        parts = [str(self.const)] if self.const or not self.terms else []
        parts += [f"{coef}·{name}" for name, coef in self.terms]
        return " + ".join(parts)


@dataclass(frozen=True)
class Row:
    """One line of a field table."""

    offset: str
    size: str
    type: str
    name: str
    doc: str


def struct_label(schema: Struct) -> str | None:
    named = NAMED_STRUCTS.get(id(schema))
    return f"[{named[0]}](#{named[1]})" if named else None


def struct_rows(schema: Struct, start: Offset, prefix: str = "") -> tuple[list[Row], Offset]:
    rows: list[Row] = []
    off = start
    for info in fields(schema):
        name = prefix + info.name
        size, typ, nxt = field_geometry(info, off)
        if info.kind == "struct" and struct_label(info.struct) is None:  # anonymous nested Struct: expand it
            assert info.struct is not None
            inner, off = struct_rows(info.struct, off, prefix=name + ".")
            rows += inner
            continue
        rows.append(Row(str(off), size, typ, f"`{name}`", info.doc))
        off = nxt
    return rows, off


def field_geometry(info: FieldInfo, off: Offset) -> tuple[str, str, Offset]:
    """(size text, type text, next offset) of one field at ``off``."""
    if info.kind == "int":
        return str(info.length), int_label(info.fmt), off.plus(info.length)
    if info.kind == "bytes":
        return str(info.length), f"u8[{info.length}]", off.plus(info.length)
    if info.kind == "struct":
        assert info.struct is not None
        label = struct_label(info.struct) or "struct"
        return str(info.length), label, off.plus(info.length)
    elem = element_size(info)
    if info.kind == "array":
        elem_label = int_label(info.fmt)
    else:
        assert info.struct is not None
        elem_label = struct_label(info.struct) or "struct"
    typ = f"{elem_label}[{info.count}]"
    if isinstance(info.count, int):
        return str(info.length), typ, off.plus(info.length)
    return f"{elem}·{info.count}", typ, off.plus(term=(info.count, elem))


def payload_rows(payload: Payload, request: Payload | None = None) -> list[Row]:
    """Every field of a payload with its offset, size, type and doc (bulk data included as a last row)."""
    if payload.shape is Shape.RAW:
        src = " × ".join(f"request.{name}" for name in payload.length_from or ("size",))
        return [Row("0", src, "bytes", "`data`", payload.doc)]
    rows, end = struct_rows(payload.schema, Offset())
    if payload.shape is Shape.HEADER_DATA:
        rows.append(Row(str(end), "n", "bytes", "`data`", f"{payload.doc} (n = payload_size − {end})"))
    return rows


def payload_size(payload: Payload, *, reply: bool = False) -> str:
    """The size rule of a payload in words (``reply``: it is checked by the client, not the server)."""
    if payload.shape is Shape.FIXED:
        n = payload.schema.sizeof()
        who = "the client aborts" if reply else "the server closes"
        return f"fixed, exactly {n} bytes (any other payload_size: {who})"
    if payload.shape is Shape.HEADER_DATA:
        n = payload.schema.sizeof()
        return f"variable, {n}-byte header + n data bytes (payload_size ≥ {n}; every byte after the header is data)"
    if payload.shape is Shape.RAW:
        names = " × ".join(f"`{name}`" for name in payload.length_from or ("size",))
        return f"variable, exactly the request's {names} bytes"
    _, end = struct_rows(payload.schema, Offset())
    return f"variable, {end} bytes (payload_size ≥ {payload.header_size}; trailing bytes are ignored)"


def markdown_table(rows: Iterable[Row]) -> str:
    rows = list(rows)
    if not rows:
        return "Empty payload: no fields.\n"
    lines = ["| off | size | type | field | description |", "|---|---|---|---|---|"]
    lines += [f"| {r.offset} | {r.size} | {r.type} | {r.name} | {linked(cell(r.doc))} |" for r in rows]
    return "\n".join(lines) + "\n"


_NBYTES = re.compile(r"(?<![`\[#])\bnbytes\b(?![`\]])")


def linked(text: str) -> str:
    """``text`` with each bare mention of nbytes linked to its one definition (``#nbytes``)."""
    return _NBYTES.sub("[nbytes](#nbytes)", text)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}."


def hex_bytes(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


