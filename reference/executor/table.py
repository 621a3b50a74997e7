"""The supported ops x types table, generated from the kernel registrations (never written by hand)."""

from __future__ import annotations

from typing import Any

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, type_name

from .core import KERNELS, READABLE, SUPPORT, WRITABLE
from .memory import I32, I64

#: Table columns: every type some kernel reads or writes, in ggml's numbering.
COLUMNS: tuple[int, ...] = tuple(sorted(set(READABLE) | set(WRITABLE) | {I32, I64}))
_FREE = ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")


def supported_ops() -> list[dict[str, Any]]:
    """One dict per op (or op/sub-op): ``op``, ``src`` and ``dst`` type names, ``note``."""
    rows = [{"op": name, "src": [], "dst": [], "note": "memory only: costs nothing"} for name in _FREE]
    for s in sorted(SUPPORT, key=lambda s: s.op):
        rows.append({
            "op": s.op,
            "src": [type_name(t) for t in s.src_types],
            "dst": [type_name(t) for t in s.dst_types],
            "note": s.note,
        })
    return rows


def unsupported_ops() -> list[str]:
    """Names of the ggml ops the executor refuses (native-callback ops included)."""
    free = {int(getattr(GgmlOp, n)) for n in _FREE}
    return [op.name for op in GgmlOp if (int(op) not in KERNELS and int(op) not in free) or op in NATIVE_CALLBACK_OPS]


def render_ops_table() -> str:
    """The table as Markdown: ``r`` = read as a source, ``w`` = written as a result."""
    names = [type_name(t) for t in COLUMNS]
    lines = [
        "# Ops supported by the reference executor",
        "",
        "Generated from the executor's kernel registrations (`ggml-rpc serve --list-ops` prints the same table).",
        "`r`: the op reads source 0 of this type; `w`: the op writes a result of this type.",
        "",
        "| op | " + " | ".join(names) + " | note |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for row in supported_ops():
        cells = []
        for name in names:
            mark = ("r" if name in row["src"] else "") + ("w" if name in row["dst"] else "")
            cells.append(mark)
        lines.append(f"| {row['op']} | " + " | ".join(cells) + f" | {row['note']} |")
    lines += [
        "",
        "Refused (the connection is closed with a message naming the op): " + ", ".join(unsupported_ops()) + ".",
        "MAP_CUSTOM1/2/3 and CUSTOM carry native function pointers and are never executed.",
        "",
    ]
    return "\n".join(lines)
