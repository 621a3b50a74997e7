"""Near-valid requests: a valid request with exactly one flaw, its kind and place chosen from the schema.

Every leaf field of a payload (nested tensors included) is classified by its declared name into the kind of flaw
it can carry -- an **id** (a handle or a tensor id), a **bound** (an offset, a size, an address, a shape, a device
index), a **type** (ggml type, op), a **flag** (cache flag, tensor flags) -- and every counted array's count field
into **count**.  Two wire-level flaws apply to any message: a lying **size** header and a **truncation** (the
message cut, then the connection ended).  A flaw replaces one value by a boundary value of its kind, computed from
the state the request refers to (one past the buffer end, a handle of another connection, a removed type...).  A
new command gets its near-valid variants from its schema like any other.  (These kinds are the fuzzer's own; the
rule table's rules, :mod:`ggml_rpc.spec.rules`, are what a server is judged by.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from typing import Any

from construct import Struct
from ggml_rpc.spec import (
    GGML_OP_COUNT,
    GGML_TYPE_COUNT,
    NATIVE_CALLBACK_OPS,
    NEVER_ON_WIRE,
    TYPES,
    Payload,
    Protocol,
    Shape,
    TensorFlag,
    ggml_nbytes,
)
from ggml_rpc.spec.codec import REQUEST_HEADER_SIZE
from ggml_rpc.spec.geometry import Span, outside_addresses
from ggml_rpc.spec.schema_walk import element_size, int_range
from hypothesis import strategies as st

from .draws import Draw, HypothesisDraw
from .message import FuzzMessage
from .valid_requests import Scope, payload_fields

#: The kinds of flaw a near-valid request carries (the part of its ``broken`` text before the colon).
FLAWS = ("size", "id", "bound", "type", "count", "truncation", "flag")

#: Which kind of flaw a field can carry, by the name the schemas give it.
FIELD_FLAWS: dict[str, str] = {
    "remote_ptr": "id", "buffer": "id", "id": "id", "src": "id", "view_src": "id", "nodes": "id",
    "offset": "bound", "size": "bound", "data": "bound", "view_offs": "bound", "ne": "bound", "nb": "bound",
    "device": "bound", "n_copies": "bound", "stride": "bound", "rank": "bound",
    "uid": "id",
    "type": "type", "op": "type",
    "cache_flag": "flag", "flags": "flag",
}

REMOVED_TYPES = tuple(t for t, info in TYPES.items() if info.removed)
U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class FlawSite:
    """One place a flaw can be put: its kind, the dotted path of the field ('' for the wire's), its format."""

    flaw: str
    path: str
    fmt: str = ""
    #: Array fields: number of elements (an int) or the name of the count field; 1 for scalars.
    count: int | str = 1


def _walk(schema: Struct, prefix: str, out: list[FlawSite]) -> None:
    for info in payload_fields(schema):
        path = prefix + info.name
        if info.kind in ("struct", "struct_array"):
            assert info.struct is not None
            sub = path + ("." if info.kind == "struct" else ".*.")
            _walk(info.struct, sub, out)
            continue
        if isinstance(info.count, str) and info.kind == "array":
            pass  # counted int array: its elements keep their own kind below
        flaw = FIELD_FLAWS.get(info.name)
        if flaw is not None and info.kind in ("int", "array"):
            out.append(FlawSite(flaw, path, info.fmt, info.count if info.kind == "array" else 1))
    for count_name in [f.count for f in payload_fields(schema) if isinstance(f.count, str)]:
        out.append(FlawSite("count", prefix + count_name, "I"))


@cache
def flaw_sites(payload: Payload) -> tuple[FlawSite, ...]:
    """Every place of ``payload`` where one flaw can be put (the wire's first)."""
    out = [FlawSite("size", ""), FlawSite("truncation", "")]
    if payload.shape is not Shape.RAW:
        _walk(payload.schema, "", out)
    return tuple(out)


def count_offset(payload: Payload, values: dict[str, Any], count_name: str) -> int:
    """Byte offset of a count field inside the encoded payload, walking the schema with the drawn arrays."""
    offset = 0
    for info in payload_fields(payload.schema):
        if info.name == count_name:
            return offset
        if isinstance(info.count, str):
            offset += element_size(info) * len(values[info.name])
        else:
            offset += info.length if info.kind != "int" else struct.calcsize("<" + info.fmt)
    raise KeyError(count_name)


def _get(values: Any, parts: list[str]) -> Any:
    for p in parts:
        values = values[int(p)] if isinstance(values, list) else values[p]
    return values


def _set(values: Any, parts: list[str], new: Any) -> Any:
    """A copy of ``values`` with the leaf at ``parts`` replaced (containers on the path are copied)."""
    if not parts:
        return new
    head, rest = parts[0], parts[1:]
    if isinstance(values, list):
        copy = list(values)
        copy[int(head)] = _set(copy[int(head)], rest, new)
        return copy
    copy = dict(values)
    copy[head] = _set(copy[head], rest, new)
    return copy


#: The most bytes a near-valid row count may make a valid GET_TENSOR_2D read (see :func:`_bound_values`).
MAX_ROWS_READ = 1 << 20


def _boundaries(fmt: str) -> list[int]:
    lo, hi = int_range(fmt)
    vals = {lo, hi, hi - 1, 0, 1}
    if hi > 0xFF:
        vals |= {(hi + 1) // 2, 1 << 31 if hi > 1 << 31 else hi}
    return sorted(v for v in vals if lo <= v <= hi)


def _nbytes(t: dict[str, Any]) -> int:
    try:
        return ggml_nbytes(t["type"], t["ne"], t["nb"])
    except (KeyError, ValueError):
        return 0


def _tensor_of(values: dict[str, Any], parts: list[str]) -> dict[str, Any] | None:
    """The tensor dict that holds the leaf at ``parts`` (None for top-level fields)."""
    for cut in range(len(parts) - 1, 0, -1):
        node = _get(values, parts[:cut])
        if isinstance(node, dict) and "buffer" in node and "ne" in node:
            return node
    top = values.get("tensor")
    return top if isinstance(top, dict) else None


def _bound_values(scope: Scope, values: dict[str, Any], parts: list[str], leaf: str, current: int,
                  fmt: str) -> list[int]:
    """Out-of-bounds candidates for one bound field, from the state it refers to."""
    cands = _boundaries(fmt)
    t = _tensor_of(values, parts)
    nbytes = _nbytes(t) if t is not None else 0
    buf = scope.buffer_for(t["buffer"]) if t is not None else None
    if leaf == "device":
        cands += [scope.devices, scope.devices + 1]
    elif leaf == "data" and buf is not None:
        # The geometry generator's places outside the buffer (below, across, past it, inside another live one),
        # and an end that wraps 64 bits.
        others = [Span(b.handle, b.base, b.size) for b in scope.buffers if b is not buf]
        cands += outside_addresses(Span(buf.handle, buf.base, buf.size), nbytes, others=others)
        cands.append((U64 - max(nbytes, 1) + 2) & U64)
    elif leaf == "offset":
        room = (buf.base + buf.size - t["data"]) if (buf is not None and t is not None) else nbytes
        cands += [nbytes, nbytes + 1, room, room + 1, (U64 - (t["data"] if t else 0) + 1) & U64]
    elif leaf == "size":
        off = values.get("offset", 0)
        cands += [nbytes - off + 1, nbytes + 1, 1 << 32]
    elif leaf in ("n_copies", "stride"):
        # 8.0.0 rows: one row too many, a stride that runs past, and products that wrap 64 bits.
        size = max(1, values.get("size", 1))
        cands += [current + 1, nbytes // size + 1, (U64 // size) + 1, 1 << 32, 1 << 63]
        if leaf == "n_copies":
            # Rows stacked closer than they are long (stride 0 repeats one row) stay inside the buffer however many
            # there are: such a count is a valid read of size * n_copies bytes (gigabytes for 2^31 rows), which
            # the model would have to hold whole to judge. Kept: counts that run past the buffer, wrap 64 bits, or
            # ask for little.
            stride = values.get("stride", 0)
            cands = [c for c in cands if stride * max(0, c - 1) + size > nbytes or size * c > U64
                     or size * c <= MAX_ROWS_READ]
    elif leaf in ("ne", "nb"):
        cands += [current + 1, current * 2, current * 4096]
    lo, hi = int_range(fmt)
    return sorted({c for c in cands if lo <= c <= hi and c != current})


def _id_values(scope: Scope, leaf: str, current: int, fmt: str, values: dict[str, Any]) -> list[int]:
    lo, hi = int_range(fmt)
    cands = [0, 1, hi, current ^ 1, (current + 0x1000) & hi]
    if leaf in ("remote_ptr", "buffer"):
        cands += [b.handle for b in scope.all_buffers[-8:]]  # handles of other (maybe closed) connections
    if leaf in ("src", "view_src", "nodes", "id") and "tensors" in values:
        cands += [int(t["id"]) ^ 0xDEAD for t in values["tensors"][:2]]
    return sorted({c for c in cands if lo <= c <= hi and c != current})


def _type_values(leaf: str) -> list[int]:
    if leaf == "type":
        return [GGML_TYPE_COUNT, GGML_TYPE_COUNT + 1, 0xFFFFFFFF, *REMOVED_TYPES]
    return [GGML_OP_COUNT, 0xFFFFFFFF, *sorted(NATIVE_CALLBACK_OPS)]


def _flag_values(leaf: str, current: int) -> list[int]:
    if leaf == "cache_flag":
        return [v for v in (1, 2, 0xFF, 0) if v != current]
    compute = int(TensorFlag.COMPUTE)
    return sorted({current ^ compute, -1, 0x7FFFFFFF, compute | int(TensorFlag.PARAM)} - {current})


def _leaf_paths(values: dict[str, Any], site: FlawSite) -> list[list[str]]:
    """Concrete element paths for a site's path with ``*`` (array of structs) and array leaves."""
    paths: list[list[str]] = [[]]
    for part in site.path.split("."):
        nxt = []
        for p in paths:
            if part == "*":
                n = len(_get(values, p))
                nxt += [[*p, str(i)] for i in range(n)]
            else:
                nxt.append([*p, part])
        paths = nxt
    out = []
    for p in paths:
        try:
            leaf = _get(values, p)
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(leaf, list):
            out += [[*p, str(i)] for i in range(len(leaf))]
        elif isinstance(leaf, int):
            out.append(p)
    return out


def unknown_commands(protocol: Protocol) -> list[int]:
    """Command bytes a server of ``protocol`` must close on: sentinels, ids past the table, the top byte."""
    count = protocol.command_count
    defined = {protocol.wire_id(c) for c in protocol.commands}
    return sorted({*(protocol.wire_id(c) for c in NEVER_ON_WIRE), count, count + 1, 0xFF} - defined)


def size_claims(payload: Payload, actual: int) -> list[int]:
    """Lying size headers for a payload of this shape (the real length excluded)."""
    head = payload.header_size
    cands = {0, 1 << 32, 1 << 62, 1 << 63, U64}
    if payload.shape is Shape.FIXED:
        cands |= {head + 1, head + 8, max(0, head - 1)}
    else:
        cands |= {max(0, head - 1), actual + 1, actual + 4096, actual + 4097}
    return sorted(c for c in cands if c != actual)


def break_one(d: Draw, scope: Scope, msg: FuzzMessage, protocol: Protocol) -> FuzzMessage:
    """``msg`` with exactly one flaw (its kind and place drawn from the payload's flaw sites)."""
    payload = protocol.commands[msg.command].request
    wire, _ = msg.encode(protocol)
    options = [t for t in flaw_sites(payload) if t.flaw in ("size", "truncation") or _leaf_paths(msg.fields, t)
               or t.flaw == "count"]
    site = d.choice(options)
    out = FuzzMessage(msg.command, msg.fields, msg.data, tags=(site.flaw,))
    if site.flaw == "size":
        out.size = d.choice(size_claims(payload, len(wire) - REQUEST_HEADER_SIZE))
        out.broken = f"size: header claims {out.size} bytes"
        return out
    if site.flaw == "truncation":
        out.cut = d.integer(1, len(wire) - 1) if len(wire) > 1 else 0
        out.broken = f"truncation: cut after {out.cut} of {len(wire)} bytes"
        return out
    if site.flaw == "count":
        name = site.path
        real = len(msg.fields[{f.count: f.name for f in payload_fields(payload.schema)
                               if isinstance(f.count, str)}[name]])
        count_fmt = "<" + next(f for f in payload_fields(payload.schema) if f.name == name).fmt
        top = int_range(count_fmt[1:])[1]
        lie = d.choice(sorted({real + 1, max(0, real - 1), 0, top, (top + 1) // 2} - {real}))
        out.patch = (count_offset(payload, msg.fields, name), struct.pack(count_fmt, lie))
        out.broken = f"count: {name} = {lie} for {real}"
        return out
    parts = d.choice(_leaf_paths(msg.fields, site))
    leaf = site.path.rsplit(".", 1)[-1]
    current = _get(msg.fields, parts)
    fmt = site.fmt
    if site.flaw == "bound":
        cands = _bound_values(scope, msg.fields, parts, leaf, current, fmt)
    elif site.flaw == "id":
        cands = _id_values(scope, leaf, current, fmt, msg.fields)
    elif site.flaw == "type":
        cands = _type_values(leaf)
    else:
        cands = _flag_values(leaf, current)
    lo, hi = int_range(fmt)
    cands = [c for c in cands if lo <= c <= hi and c != current] or [hi if current != hi else lo]
    value = d.choice(cands)
    new_fields = _set(msg.fields, parts, value)
    if site.flaw == "type" and leaf == "op":
        # An op only runs when its node is computed: keep the COMPUTE flag on the broken node.
        tparts = parts[:-1]
        node = _get(new_fields, tparts)
        if isinstance(node, dict) and "flags" in node:
            new_fields = _set(new_fields, [*tparts, "flags"], int(node["flags"]) | int(TensorFlag.COMPUTE))
    out.fields = new_fields
    out.broken = f"{site.flaw}: {'.'.join(parts)} = {value:#x}" if value >= 0 else \
        f"{site.flaw}: {'.'.join(parts)} = {value}"
    return out


@st.composite
def near_valid(draw: st.DrawFn, scope: Scope, msg: FuzzMessage, protocol: Protocol) -> FuzzMessage:
    """Hypothesis strategy of :func:`break_one` (the kind of flaw, its place and its value shrinkable)."""
    return break_one(HypothesisDraw(draw), scope, msg, protocol)
