"""reference/OPS.md: the reference executor's ops x types (read from its kernel registrations) with, beside each op,
the test-backend-ops counts recorded from interop runs (:mod:`.op_counts`).

``python -m ggml_rpc.conformance.upstream.ops_table`` prints it; ``--record FILE`` first merges the OPS-* rows of a
``ggml-rpc interop --json FILE`` result into conformance/upstream/op_counts.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ggml_rpc.reference.executor.grids import GRID_TYPES
from ggml_rpc.reference.executor.table import COLUMNS, FREE_NAMES, supported_ops, unsupported_ops
from ggml_rpc.spec import type_name

from . import closeness, op_counts


def _counts_cell(counts: dict[str, Any], label: str) -> str:
    if label in ("UNARY", "GLU"):
        return "see the sub-op rows"
    if label in FREE_NAMES:
        return ""
    # test-backend-ops names the UNARY and GLU sub-ops by themselves (SILU, SWIGLU).
    return op_counts.cell(counts, label.split("/", 1)[-1])


def render_ops_table(counts: dict[str, Any] | None = None, closeness_data: dict[str, Any] | None = None) -> str:
    """The table as Markdown: ``r`` = read as a source, ``w`` = written as a result; beside each op the
    recorded test-backend-ops counts (``conformance/upstream/op_counts.json`` unless ``counts`` is given); then the
    recorded closeness to upstream per op (``op_closeness.json`` unless ``closeness_data`` is given)."""
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
    lines += closeness.section(closeness_data)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (after merging ``--record`` results into the committed counts)."""
    parser = argparse.ArgumentParser(prog="python -m ggml_rpc.conformance.upstream.ops_table")
    parser.add_argument("--record", metavar="FILE", action="append", default=[],
                        help="merge this `ggml-rpc interop --rows 'OPS*' --json` result into op_counts.json")
    args = parser.parse_args(argv)
    data = op_counts.load()
    for path in args.record:
        data, measured = op_counts.record(data, json.loads(Path(path).read_text(encoding="utf-8")))
        print(f"{path}: recorded {len(measured)} ops", file=sys.stderr)
    if args.record:
        op_counts.COUNTS_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(render_ops_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
