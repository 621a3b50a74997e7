"""The test-backend-ops pass counts shown beside each op in reference/OPS.md, and how they are recorded.

The counts come only from ``ggml-rpc interop --rows 'OPS*' --json FILE`` runs (upstream test-backend-ops run one
op at a time through the reference server v7 and through upstream's own rpc-server v7).  ``record`` merges the
OPS-* rows of such a run into the committed ``conformance/upstream/op_counts.json``: an op keeps the figures of the
last run that measured it, together with that run's date, commit and upstream build.  Nothing here computes a count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The committed record: interop results, kept with the interop matrix that produces them.
COUNTS_FILE = Path(__file__).resolve().with_name("op_counts.json")
FORMAT = "ggml-rpc-op-counts/1"
_ROW_PREFIX = "OPS-"


def empty() -> dict[str, Any]:
    return {"format": FORMAT, "runs": [], "ops": {}}


def load(path: Path = COUNTS_FILE) -> dict[str, Any]:
    """The recorded counts (an empty record when the file does not exist)."""
    if not path.exists():
        return empty()
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    return data


def record(counts: dict[str, Any], interop: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``counts`` with the OPS-* rows of one interop JSON result merged in; also the ops it recorded."""
    if interop.get("format") != "ggml-rpc-interop/1":
        raise ValueError("not a `ggml-rpc interop --json` result")
    run = {key: interop.get(key, "unknown") for key in ("date", "commit", "machine")}
    run["upstream"] = interop.get("upstream", {}).get("7.0.0", "unknown")
    ops = dict(counts.get("ops", {}))
    runs = list(counts.get("runs", []))
    # Runs of one commit against one build on one machine are one recorded run (the op rows of a long campaign
    # may come from several invocations); its date then spans them.
    key = (run["commit"], run["upstream"], run["machine"])
    index = next((i for i, r in enumerate(runs) if (r["commit"], r["upstream"], r["machine"]) == key), len(runs))
    measured = []
    for row in interop.get("rows", []):
        figures = row.get("figures") or {}
        if not row.get("id", "").startswith(_ROW_PREFIX) or "reference" not in figures or "upstream" not in figures:
            continue
        op = row["id"][len(_ROW_PREFIX) :]
        ops[op] = {"reference": list(figures["reference"]), "upstream": list(figures["upstream"]),
                   "status": row.get("status", "unknown"), "run": index}
        measured.append(op)
    if measured and index == len(runs):
        runs.append(run)
    elif measured:
        first = runs[index]["date"].split(" to ")[0]
        runs[index] = {**runs[index], "date": first if first == run["date"] else f"{first} to {run['date']}"}
    # Keep only the runs some op still refers to, renumbered in order.
    used = sorted({entry["run"] for entry in ops.values()})
    renumber = {old: new for new, old in enumerate(used)}
    return ({"format": FORMAT, "runs": [runs[i] for i in used],
             "ops": {op: {**entry, "run": renumber[entry["run"]]} for op, entry in sorted(ops.items())}}, measured)


def cell(counts: dict[str, Any], op: str) -> str:
    """``reference passed/total; upstream passed/total`` for an OPS.md row, or why there is no figure."""
    entry = counts.get("ops", {}).get(op)
    if entry is None:
        return "not run in the recorded runs"
    (rp, rt), (up, ut) = entry["reference"], entry["upstream"]
    if ut == 0 and rt == 0:
        return "no case on RPC0"
    mark = "" if rp >= up else " **short**"
    return f"{rp}/{rt}; {up}/{ut}{mark} (run {entry['run'] + 1})"


def header(counts: dict[str, Any]) -> list[str]:
    """The OPS.md lines naming the runs the counts come from."""
    runs = counts.get("runs", [])
    if not runs:
        return ["No test-backend-ops run is recorded yet "
                "(`python -m ggml_rpc.conformance.upstream.ops_table --record FILE`)."]
    lines = ["`test-backend-ops`: cases passed/total through the reference server v7, then through upstream's",
             "rpc-server v7 (same build, same cases), from these `ggml-rpc interop --rows 'OPS*' --json` runs:", ""]
    for i, run in enumerate(runs):
        lines.append(f"{i + 1}. {run['date']}, commit {run['commit']}, upstream {run['upstream']}; {run['machine']}")
    return lines
