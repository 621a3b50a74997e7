"""The supported ops x types, read from the kernel registrations (never written by hand); the Markdown table of
reference/OPS.md, with the interop runs' counts beside each op, is rendered by
:mod:`ggml_rpc.conformance.upstream.ops_table`."""

from __future__ import annotations

from typing import Any

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, type_name

from .core import KERNELS, READABLE, SUPPORT, WRITABLE
from .memory import I32, I64

#: Table columns: every type some kernel reads or writes, in ggml's numbering.
COLUMNS: tuple[int, ...] = tuple(sorted(set(READABLE) | set(WRITABLE) | {I32, I64}))
FREE_NAMES = ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")


def supported_ops() -> list[dict[str, Any]]:
    """One dict per op (or op/sub-op): ``op``, ``src`` and ``dst`` type names, ``note``."""
    rows = [{"op": name, "src": [], "dst": [], "note": "memory only: costs nothing"} for name in FREE_NAMES]
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
    free = {int(getattr(GgmlOp, n)) for n in FREE_NAMES}
    return [op.name for op in GgmlOp if (int(op) not in KERNELS and int(op) not in free) or op in NATIVE_CALLBACK_OPS]
