"""A Wireshark Lua dissector generated from the spec tables.

Nothing about a message is written here by hand: :func:`generate` walks the construct Structs of every payload of
every protocol table (``spec.versions.PROTOCOLS`` or whatever tables it is given) and emits

* one ``ProtoField`` per distinct field (abbreviation ``ggml_rpc.<name>``; fields of a nested Struct such as
  ``rpc_tensor`` live under ``ggml_rpc.<prefix>.<name>``), with the field's construct doc string as its blurb;
* a layout table per Struct (kind, size, fixed or ``this.<field>`` count) that one generic Lua walker interprets;
* one table per protocol version: request and reply layout of each command, the no-reply set, RAW reply lengths;
* value strings for commands, ggml types, ops, UNARY/GLU sub-ops and tensor flags, and the type geometry
  (block size, type size) that the ``nbytes`` bounds checks need.

The fixed Lua runtime (:mod:`.runtime`) does the TCP reassembly, per-conversation state, reply
pairing, version pick from the HELLO reply and the expert info; it names no command and no field layout.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from .. import rules
from ..enums import NEVER_ON_WIRE, TYPES, Command, GgmlOp, GluOp, TensorFlag, UnaryOp
from ..facts import DEFAULT_PORT
from ..framing import ReplyFramer, RequestFramer
from ..messages import GRAPH_MIN_SIZE, Payload
from ..payloads import DEFAULT_MAX_PAYLOAD
from ..versions import PROTOCOLS, Protocol
from .lua_runtime import RUNTIME
from .lua_tables import PROTO_NAME, GeneratorError, LayoutBuilder, LuaField, offset_of, width_of

#: GRAPH_COMPUTE payloads up to this size are reassembled and decoded in full; larger ones show their header.
GRAPH_REASSEMBLE_MAX = 64 << 20

# Presentation choices (how a value is shown, never where it is): hex for addresses and ids, names for enums.
HEX_FIELDS = frozenset({"id", "buffer", "src", "view_src", "data", "remote_ptr", "base_ptr", "nodes", "hash"})
_LUA_FIELD_TYPES = {"u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64", "i8": "int8", "i16": "int16",
                    "i32": "int32", "i64": "int64", "bytes": "bytes", "string": "string"}


def lua_str(text: str) -> str:
    """A Lua string literal."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\{ord(ch):03d}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _value_table(name: str, items: Iterable[tuple[int, str]]) -> str:
    body = ", ".join(f"[{value}] = {lua_str(label)}" for value, label in items)
    return f"local {name} = {{ {body} }}"


def _enum_items(e: type[enum.Enum]) -> list[tuple[int, str]]:
    return [(int(m.value), m.name) for m in e]


def generate(protocols: Sequence[Protocol] = PROTOCOLS, *, port: int = DEFAULT_PORT,
             reassemble_bulk: bool = False) -> str:
    """The Lua source of a dissector for the given protocol tables (oldest first).

    ``reassemble_bulk`` makes Wireshark reassemble whole messages, bulk data included, so each message sits in one
    frame (at the cost of holding the largest one in memory); by default bulk bytes are only counted.
    """
    if not protocols:
        raise GeneratorError("no protocol table given")
    value_fields = {
        f"{PROTO_NAME}.tensor.type": "VS_TYPE",
        f"{PROTO_NAME}.tensor.op": "VS_OP",
    }
    b = LayoutBuilder(value_fields)
    # Framing: the request header is (cmd u8, size u64), the reply header (size u64).
    header_fields = {
        # No value string: a command's id belongs to a version (19 is GET_TENSOR_2D in 8.0.0), so the runtime names
        # it from the connection's version table.
        "cmd": b.add_field(f"{PROTO_NAME}.cmd", "Command", "u8", "request command byte"),
        "len": b.add_field(f"{PROTO_NAME}.len", "Payload length", "u64", "size header: payload bytes that follow"),
    }
    tables: list[str] = []
    hello_reply: Payload | None = None
    for proto in protocols:
        rows = []
        for cmd, spec in proto.commands.items():
            req = b.payload(spec.request)
            if spec.has_reply:
                assert isinstance(spec.reply, Payload)
                rep = b.payload(spec.reply, request=spec.request)
                reply_ref = f"PAYLOADS[{rep}]"
                if cmd is Command.HELLO:
                    hello_reply = spec.reply
            else:
                reply_ref = "nil"
            rows.append(f"    [{proto.wire_id(cmd)}] = {{ name = {lua_str(cmd.name)}, request = PAYLOADS[{req}], "
                        f"reply = {reply_ref}, doc = {lua_str(spec.doc)} }},")
        label = proto.label
        tables.append(
            f"PROTOCOLS[#PROTOCOLS + 1] = {{ label = {lua_str(label)}, major = {proto.version[0]}, "
            f"minor = {proto.version[1]}, patch = {proto.version[2]}, sentinel = {proto.sentinel}, "
            f"commands = {{\n" + "\n".join(rows) + "\n} }"
        )
    if hello_reply is None:
        raise GeneratorError("the tables have no HELLO reply: the version cannot be learnt")
    hello_req = protocols[0].commands[Command.HELLO].request

    extra = {
        "dir": b.add_field(f"{PROTO_NAME}.dir", "Direction", "string", "request or reply"),
        "pdu": b.add_field(f"{PROTO_NAME}.pdu", "Message", "string",
                           "one line per message: direction, command, request index, payload length, violations"),
        "index": b.add_field(f"{PROTO_NAME}.index", "Request index", "u32",
                             "position of the request in its connection (a reply carries its request's index)"),
        "version": b.add_field(f"{PROTO_NAME}.version", "Protocol version", "string",
                               "version table used (from the HELLO reply)"),
        "violations": b.add_field(f"{PROTO_NAME}.violations", "Spec violations", "u32",
                                  "number of spec violations found in this message"),
        "data_len": b.add_field(f"{PROTO_NAME}.data_len", "Bulk data length", "u64",
                                "bytes of bulk data carried by this message (shown as a length, not a dump)"),
        "data_here": b.add_field(f"{PROTO_NAME}.data_in_segment", "Bulk data in this segment", "u32",
                                 "bulk data bytes of this message present in this segment"),
        "cont": b.add_field(f"{PROTO_NAME}.continuation", "Continuation bytes", "u32",
                            "bulk data of a message that started in an earlier segment"),
        "cont_left": b.add_field(f"{PROTO_NAME}.continuation_left", "Bulk bytes still to come", "u64",
                                 "bulk data bytes of that message after this segment"),
        "trailing": b.add_field(f"{PROTO_NAME}.trailing", "Trailing bytes", "u32",
                                "bytes after the last decoded field of a message"),
        "ignored": b.add_field(f"{PROTO_NAME}.ignored", "Undecoded bytes", "u32",
                               "bytes after a violation that ends the session (the peer closes or aborts)"),
        "shape": b.add_field(f"{PROTO_NAME}.tensor.shape", "shape", "string", "type and ne of the tensor"),
        "nbytes": b.add_field(f"{PROTO_NAME}.tensor.nbytes", "nbytes", "u64",
                              "bytes the tensor spans (ggml_nbytes, strides as sent)"),
        "unary": b.add_field(f"{PROTO_NAME}.tensor.unary_op", "unary op", "i32", "op_params[0] of a UNARY node",
                             "VS_UNARY"),
        "glu": b.add_field(f"{PROTO_NAME}.tensor.glu_op", "glu op", "i32", "op_params[0] of a GLU node", "VS_GLU"),
    }
    flag_fields = [
        (flag, b.add_field(f"{PROTO_NAME}.tensor.flags.{flag.name.lower()}", flag.name, "flag",
                           f"tensor flag {flag.name}"))
        for flag in TensorFlag
    ]

    lines: list[str] = []
    add = lines.append
    versions = ", ".join(p.label for p in protocols)
    add(f"-- ggml RPC dissector for Wireshark / tshark, protocol versions {versions}.")
    add("-- GENERATED by `ggml-rpc dissector` from the ggml-rpc-kit spec tables: do not edit, regenerate.")
    add("-- Install: copy into ~/.local/lib/wireshark/plugins/ (Wireshark's personal Lua plugins folder).")
    add("")
    add(f"local P = Proto({lua_str(PROTO_NAME)}, {lua_str('ggml RPC (llama.cpp rpc-server)')})")
    add("")
    add("-- value strings")
    # Names of the ids of 6.0.0-7.0.1, for a connection whose version is not known yet.
    add(_value_table("VS_CMD", [(v, n) for v, n in _enum_items(Command) if v < 0x100]))
    add(_value_table("VS_TYPE", [(t.id, t.name) for t in TYPES.values()]))
    add(_value_table("VS_OP", _enum_items(GgmlOp)))
    add(_value_table("VS_UNARY", _enum_items(UnaryOp)))
    add(_value_table("VS_GLU", _enum_items(GluOp)))
    add("-- ggml type geometry: block size (elements) and bytes per block; block 0 = removed type")
    add("local TYPES = { " + ", ".join(f"[{t.id}] = {{ blck = {t.blck}, size = {t.size} }}" for t in TYPES.values())
        + " }")
    add(f"local TYPE_COUNT = {len(TYPES)}")
    add("")
    lines.extend(rule_tables())
    add("")
    add("-- fields")
    add("local F = {}")
    for f in b.fields.values():
        add(f"{f.var} = {_protofield(f)}")
    add("local FLAG_FIELDS = { " + ", ".join(f"{{ {int(flag)}, {f.var} }}" for flag, f in flag_fields) + " }")
    add("local HF = { " + ", ".join(f"{k} = {f.var}" for k, f in {**header_fields, **extra}.items()) + " }")
    add("-- (P.fields is assigned once, by the runtime, after it adds its own fields)")
    add("")
    add("-- layouts: one per Struct of the spec, in declaration order")
    add("local LAYOUTS = {}")
    for lay in b.layouts:
        elems = []
        for e in lay.elems:
            parts = [f"name = {lua_str(e.name)}", f"kind = {lua_str(e.kind)}", f"size = {e.size}",
                     f"pf = {e.field.var}"]
            if e.count is not None:
                parts.append(f"count = {e.count}")
            if e.count_from is not None:
                parts.append(f"count_from = {lua_str(e.count_from)}")
            if e.layout is not None:
                parts.append(f"layout = {e.layout}")
            if e.values is not None:
                parts.append(f"values = {e.values}")
            if e.kind == "u64" and e.name in HEX_FIELDS:
                parts.append("hex = true")
            elems.append("    { " + ", ".join(parts) + " },")
        size = "nil" if lay.size is None else str(lay.size)
        add(f"LAYOUTS[{lay.index}] = {{ size = {size}, prefix = {lua_str(lay.prefix)}, "
            f"is_tensor = {str(lay.is_tensor).lower()}, elems = {{\n" + "\n".join(elems) + "\n} }")
    add("")
    add("-- payloads: shape, layout, size of the fixed part")
    add("local PAYLOADS = {}")
    for index, p in enumerate(b.payloads, 1):
        length = "{ " + ", ".join(f"{{ {off}, {width} }}" for off, width in p.length_from) + " }"
        add(f"PAYLOADS[{index}] = {{ shape = {lua_str(p.shape)}, layout = LAYOUTS[{p.layout}], size = {p.size}, "
            f"length_from = {length} }}")
    add("")
    add("-- one table per protocol version, oldest first")
    add("local PROTOCOLS = {}")
    lines.extend(tables)
    add("")
    add("local C = {")
    add(f"  PORT = {port},")
    add(f"  HELLO = {int(Command.HELLO)},")
    add(f"  HELLO_SIZE = {hello_req.header_size},")
    add(f"  HELLO_MAJOR_OFF = {offset_of(hello_reply.schema, 'major')},")
    add(f"  HELLO_MINOR_OFF = {offset_of(hello_reply.schema, 'minor')},")
    add(f"  HELLO_PATCH_OFF = {offset_of(hello_reply.schema, 'patch')},")
    add(f"  HELLO_VER_LEN = {width_of(hello_reply.schema, 'major')},")
    # Header widths are the framer's (the codec's streaming mode), which every other part of the kit frames with.
    add(f"  REQ_HDR = {RequestFramer.header_size},")
    add(f"  REP_HDR = {ReplyFramer.header_size},")
    # A request header is the command byte then the same size field a reply header is made of.
    add(f"  SIZE_LEN = {ReplyFramer.header_size},")
    add(f"  CMD_LEN = {RequestFramer.header_size - ReplyFramer.header_size},")
    add(f"  MAX_PAYLOAD = {DEFAULT_MAX_PAYLOAD},")
    add(f"  GRAPH_MIN = {GRAPH_MIN_SIZE},")
    add(f"  REASSEMBLE_BULK = {str(reassemble_bulk).lower()},")
    add(f"  GRAPH_REASSEMBLE_MAX = {GRAPH_REASSEMBLE_MAX},")
    add(f"  UNARY_OP = {int(GgmlOp.UNARY)},")  # type: ignore[attr-defined]
    add(f"  GLU_OP = {int(GgmlOp.GLU)},")  # type: ignore[attr-defined]
    add(f"  SENTINEL_NAME = {lua_str(Command.NONE.name)},")
    add("  NEVER_ON_WIRE = { " + ", ".join(f"[{protocols[0].wire_id(c)}] = true" for c in sorted(NEVER_ON_WIRE))
        + " },")
    add("}")
    add("")
    lines.append(RUNTIME)
    return "\n".join(lines) + "\n"


def rule_tables() -> list[str]:
    """The rule table's data (:mod:`ggml_rpc.spec.rules`), for the runtime's rule checks: each rule's level and text
    by id, and per command name the tensor fields whose type is checked, where a region's length comes from ("" for
    the data), the copy pair and whether rows carry data."""
    def strings(names: tuple[str, ...]) -> str:
        return "{ " + ", ".join(lua_str(n) for n in names) + " }"

    out = ["-- rules: generated from ggml_rpc.spec.rules (ids, levels and texts; the data the checks read)",
           "local R = { RULES = {"]
    out += [f"  [{lua_str(r.id)}] = {{ level = {lua_str(r.level.value)}, text = {lua_str(r.text)} }},"
            for r in rules.RULES]
    out.append("}, TENSOR_FIELDS = { " + ", ".join(f"{c.name} = {strings(f)}" for c, f in
                                                   rules.TENSOR_FIELDS.items()) + " },")
    out.append("  REGION_LENGTH = { " + ", ".join(f"{c.name} = {lua_str(n or '')}" for c, n in
                                                  rules.REGION_LENGTH.items()) + " },")
    out.append("  COPIES = { " + ", ".join(f"{c.name} = {strings(p)}" for c, p in rules.COPIES.items()) + " },")
    out.append("  ROWS = { " + ", ".join(f"{c.name} = {str(d).lower()}" for c, d in rules.ROWS.items()) + " } }")
    return out


def _protofield(f: LuaField) -> str:
    abbr, label, doc = lua_str(f.abbr), lua_str(f.label), lua_str(f.doc)
    if f.kind == "none":
        return f"ProtoField.none({abbr}, {label}, {doc})"
    if f.kind == "flag":
        return f"ProtoField.bool({abbr}, {label}, base.NONE, nil, nil, {doc})"
    if f.kind in ("bytes", "string"):
        return f"ProtoField.{_LUA_FIELD_TYPES[f.kind]}({abbr}, {label}, base.NONE, {doc})" if f.kind == "bytes" \
            else f"ProtoField.string({abbr}, {label}, base.UNICODE, {doc})"
    short = f.abbr.rsplit(".", 1)[-1]
    # Wireshark shows signed integers in decimal only.
    base = "base.HEX" if short in HEX_FIELDS and f.kind.startswith("u") else "base.DEC"
    values = f.values or "nil"
    return f"ProtoField.{_LUA_FIELD_TYPES[f.kind]}({abbr}, {label}, {base}, {values}, nil, {doc})"


def describe_fields(source: str) -> list[str]:
    """The field abbreviations a generated dissector declares (for docs and tests)."""
    out = []
    for line in source.splitlines():
        if line.startswith("F[") and "ProtoField." in line:
            out.append(line.split('("', 1)[1].split('"', 1)[0])
    return out
