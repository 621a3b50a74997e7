"""The ggml tables of the protocol reference: types, their block layouts, ops, sub-ops and flags (see
:mod:`~ggml_rpc.spec.render.markdown`, which places them)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ..blocks import QK_K, block_layout
from ..enums import NATIVE_CALLBACK_OPS, TYPES, GgmlOp
from ..op_params import OP_PARAM_SLOTS, OP_PARAMS, OP_PARAMS_SINCE, READ_NOT_LISTED, WRITTEN_NOT_READ
from ..schema_walk import fields
from ..tensor import RpcTensor

#: Offset of op_params inside an rpc_tensor (from the Struct).
_OP_PARAMS_AT = sum(f.length for f in itertools.takewhile(lambda f: f.name != "op_params", fields(RpcTensor)))


def anchor(name: str) -> str:
    """A stable link target placed before a heading."""
    return f'<a id="{name}"></a>\n'


def types_table() -> str:
    """The ggml type table."""
    out = [anchor("enum-types"), f"## ggml types (GGML_TYPE_COUNT = {len(TYPES)})\n\n"]
    out.append(
        "`blck`: elements per block, `size`: bytes per block (the [shapes](#tensor-shape) section says how they "
        "give `nb` and `nbytes`). Removed types (block size 0) are refused by every server, as are ids ≥ "
        "GGML_TYPE_COUNT. Like op ids, type ids are those of the server's ggml build (upstream's in the covered "
        "builds).\n\n| id | name | blck | size | status |\n|---|---|---|---|---|\n"
    )
    for t in TYPES.values():
        status = "removed" if t.removed else ("quantized" if t.quantized else "")
        out.append(f"| {t.id} | {t.name} | {t.blck} | {t.size} | {status} |\n")
    return "".join(out) + "\n"


def ops_table() -> str:
    """The ggml op table."""
    out = [anchor("enum-ops"), f"## ggml ops (GGML_OP_COUNT = {len(GgmlOp)})\n\n"]
    out.append(
        "An op id is ggml's own enum value as compiled into the server, not a number the protocol version fixes: "
        f"the RPC code only requires at build time that GGML_OP_COUNT is {len(GgmlOp)} (in every covered "
        "version), so a build of another ggml (a fork that adds ops) may number them differently while "
        "announcing the same version. This is the numbering of upstream ggml in the covered builds; the same "
        "holds for the [type](#enum-types) ids.\n\n| id | name | note |\n|---|---|---|\n"
    )
    for op in GgmlOp:
        note = "op_params hold a native function pointer" if op in NATIVE_CALLBACK_OPS else ""
        if op.name in ("UNARY", "GLU"):
            note = f"sub-op in op_params[0] (see [{op.name.lower()}](#enum-{op.name.lower()}))"
        if op in OP_PARAMS:
            note = "; ".join(n for n in (note, f"[op_params](#op-params-{op.name.lower()})") if n)
        out.append(f"| {int(op)} | {op.name} | {note} |\n")
    return "".join(out) + "\n"


def simple_table(name: str, title: str, enum_cls: Iterable) -> str:
    """A value/name table of an enum."""
    out = [anchor(name), f"## {title}\n\n| value | name |\n|---|---|\n"]
    out += [f"| {int(v)} | {v.name} |\n" for v in enum_cls]
    return "".join(out) + "\n"


def blocks_section() -> str:
    """One table per quantised type: its block's fields, offsets, sizes and meaning (from spec.blocks)."""
    out = [anchor("blocks"), "## Block layouts of the quantised types\n\n",
           "Tensor data of a quantised type is a sequence of blocks of `blck` elements; each block holds these "
           f"fields in this order, little-endian, unpadded (`QK_K` = {QK_K}).\n\n"]
    for t in TYPES.values():
        if not t.quantized or t.removed:
            continue
        out.append(anchor(f"block-{t.name.lower()}"))
        out.append(f"### {t.name} ({t.blck} elements, {t.size} bytes)\n\n| offset | size | field | meaning |\n"
                   "|---|---|---|---|\n")
        for f in block_layout(t.id):
            out.append(f"| {f.start} | {f.stop - f.start} | {f.name} | {f.doc} |\n")
        out.append("\n")
    return "".join(out)


def op_params_section() -> str:
    """``#op-params`` and one ``#op-params-<op>`` per op: the slots of op_params each op uses (from spec.op_params)."""
    out = [anchor("op-params"), "## op_params of each op\n\n"]
    out.append(
        f"`op_params` is {OP_PARAM_SLOTS} four-byte slots (64 bytes at offset 56 of an [rpc_tensor](#rpc_tensor)). "
        "An `i32` slot holds a little-endian integer, an `f32` slot the little-endian IEEE-754 bits of a float; "
        "slots an op does not name are 0. These are the ops whose parameters a server reads, for every op the "
        "kit computes; the CPU backend also reads those of "
        + ", ".join(GgmlOp(op).name for op in READ_NOT_LISTED)
        + " (not described here: the kit computes none of them; the MAP_CUSTOM ops and CUSTOM carry native "
        "function pointers). Every other op takes none: send 16 zero slots. "
        + " ".join(f"{GgmlOp(op).name} nodes carry {what} in op_params, but nothing computes them." for op, what in
                   WRITTEN_NOT_READ.items())
        + "\n\n"
    )
    out.append(" · ".join(f"[{GgmlOp(op).name}](#op-params-{GgmlOp(op).name.lower()})" for op in sorted(OP_PARAMS))
               + "\n\n")
    for op in sorted(OP_PARAMS):
        name = GgmlOp(op).name
        out.append(anchor(f"op-params-{name.lower()}"))
        out.append(f"### {name} ({int(op)})\n\n")
        if op in OP_PARAMS_SINCE:
            out.append(f"{OP_PARAMS_SINCE[op][:1].upper()}{OP_PARAMS_SINCE[op][1:]}.\n\n")
        out.append("| slot | op_params bytes | rpc_tensor offset | type | name | meaning |\n"
                   "|---|---|---|---|---|---|\n")
        for p in OP_PARAMS[op]:
            slots = str(p.slot) if p.count == 1 else f"{p.slot}–{p.slot + p.count - 1}"
            kind = p.kind if p.count == 1 else f"{p.kind}[{p.count}]"
            first = 4 * p.slot
            out.append(f"| {slots} | {first}–{first + 4 * p.count - 1} | {_OP_PARAMS_AT + first} | {kind} | "
                       f"`{p.name}` | {_linked_tables(p.doc)} |\n")
        out.append("\n")
    return "".join(out)


def _linked_tables(doc: str) -> str:
    return doc.replace("the GLU ops table", "[GLU ops](#enum-glu)").replace("the unary ops table",
                                                                            "[unary ops](#enum-unary)")
