"""The ggml tables of the protocol reference: types, their block layouts, ops, sub-ops and flags (see
:mod:`~ggml_rpc.spec.render.markdown`, which places them)."""

from __future__ import annotations

from collections.abc import Iterable

from ..blocks import QK_K, block_layout
from ..enums import NATIVE_CALLBACK_OPS, TYPES, GgmlOp


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
