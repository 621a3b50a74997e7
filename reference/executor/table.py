"""The supported ops x types table, generated from the kernel registrations (never written by hand)."""

from __future__ import annotations

from typing import Any

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, type_name

from . import counts as op_counts
from .core import KERNELS, READABLE, SUPPORT, WRITABLE
from .grids import GRID_TYPES
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


def _counts_cell(counts: dict[str, Any], label: str) -> str:
    if label in ("UNARY", "GLU"):
        return "see the sub-op rows"
    if label in _FREE:
        return ""
    # test-backend-ops names the UNARY and GLU sub-ops by themselves (SILU, SWIGLU).
    return op_counts.cell(counts, label.split("/", 1)[-1])


def render_ops_table(counts: dict[str, Any] | None = None) -> str:
    """The table as Markdown: ``r`` = read as a source, ``w`` = written as a result; beside each op the
    recorded test-backend-ops counts (``reference/op_counts.json`` unless ``counts`` is given)."""
    counts = op_counts.load() if counts is None else counts
    names = [type_name(t) for t in COLUMNS]
    lines = [
        "# Ops supported by the reference executor",
        "",
        "Generated from the executor's kernel registrations (`ggml-rpc serve --list-ops` prints the same table).",
        "`r`: the op reads source 0 of this type; `w`: the op writes a result of this type.",
        "",
        *op_counts.header(counts),
        "",
        "| op | " + " | ".join(names) + " | test-backend-ops: reference; upstream | note |",
        "|---|" + "---|" * len(names) + "---|---|",
    ]
    for row in supported_ops():
        cells = []
        for name in names:
            mark = ("r" if name in row["src"] else "") + ("w" if name in row["dst"] else "")
            cells.append(mark)
        tbo = _counts_cell(counts, row["op"])
        lines.append(f"| {row['op']} | " + " | ".join(cells) + f" | {tbo} | {row['note']} |")
    refused = unsupported_ops()
    lines += [
        "",
        "Refused (the connection is closed with a message naming the op): " + ", ".join(refused) + ".",
        "MAP_CUSTOM1/2/3 and CUSTOM carry native function pointers and are never executed.",
        # The table is the same on every machine; whether these columns are live depends on the upstream build.
        ", ".join(type_name(t) for t in GRID_TYPES) + " are read with codebooks taken at run time from an installed "
        "upstream build (`ggml-rpc upstream install`); without one they are refused and GET_DEVICE_SUPPORTS_OP "
        "answers false for them.",
    ]
    measured = [f"{op} {op_counts.cell(counts, op)}" for op in refused if op in counts.get("ops", {})]
    if measured:
        lines.append("Refused ops in the recorded runs: " + "; ".join(measured) + ".")
    lines.append("")
    return "\n".join(lines)
