"""The reference server against upstream over several ``ggml-rpc bench --json`` runs: one markdown table, each
figure's ratio per run and the median ratio, judged against the ratio goals (BENCHMARKS.md: the reference server
relative to upstream).

    python bench/runs_table.py RUN1.json RUN2.json RUN3.json

Ratios are reference / upstream, oriented so that above 1 the reference server is faster (for milliseconds,
upstream / reference), as the bench computes them.  The table is derived from the records only, so BENCHMARKS.md
quotes what the raw JSON beside it holds.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The ratio goals: the reference server's speed relative to upstream's, per figure key.
RATIO_GOALS = {"round_trips_1cpu": 1.0, "set_tensor_1MiB": 1.0, "graph_compute_10000": 0.8,
               "generation bench-f32": 0.7, "generation bench-q8_0": 0.7}


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "—"
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"
    return f"{text} {unit}".strip()


def figure_rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per figure key: label, unit, the reference's and upstream's medians and the ratio, from one bench record."""
    rows: dict[str, dict[str, Any]] = {}
    for fig in doc.get("server_figures", []):
        by = {r["target"]: r for r in fig["results"]}
        ref, up = by.get("reference"), next((r for n, r in by.items() if n != "reference"), None)
        if ref is None or up is None:
            continue
        ratio = up.get("ratio")
        rows[fig["key"]] = {"label": fig["label"], "unit": fig["unit"], "reference": ref.get("median"),
                            "upstream": up.get("median"),
                            "ratio": (1 / ratio) if ratio else None}  # the bench's ratio is upstream vs reference
    for g in doc.get("generation", []):
        rows[f"generation {g['model']}"] = {"label": f"generation {g['model']} (64 tokens)", "unit": "tok/s",
                                            "reference": g["reference_median"], "upstream": g["upstream_median"],
                                            "ratio": g["ratio"]}
    return rows


def table(docs: Sequence[dict[str, Any]]) -> str:
    per_run = [figure_rows(d) for d in docs]
    keys = list(dict.fromkeys(k for rows in per_run for k in rows))
    head = ["figure", "reference (median of runs)", "upstream (median of runs)",
            *(f"ratio run {i + 1}" for i in range(len(docs))), "median ratio", "goal (ratio)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        present = [rows[key] for rows in per_run if key in rows]
        first = present[0]
        ratios = [rows[key]["ratio"] if key in rows else None for rows in per_run]
        taken = [r for r in ratios if r is not None]
        med = statistics.median(taken) if taken else None
        refs = [p["reference"] for p in present if p["reference"] is not None]
        ups = [p["upstream"] for p in present if p["upstream"] is not None]
        goal = RATIO_GOALS.get(key)
        if goal is None:
            verdict = ""
        elif not taken:
            verdict = f"≥ {goal}x: not measured"
        else:
            every = all(r >= goal for r in taken)
            verdict = (f"≥ {goal}x: {'met' if med is not None and med >= goal else '**not met**'} "
                       f"(every run: {'yes' if every else 'no'})")
        lines.append("| " + " | ".join([
            first["label"], _fmt(statistics.median(refs) if refs else None, first["unit"]),
            _fmt(statistics.median(ups) if ups else None, first["unit"]),
            *(f"{r:.2f}x" if r is not None else "—" for r in ratios),
            f"{med:.2f}x" if med is not None else "—", verdict]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python bench/runs_table.py RUN.json [RUN.json ...]", file=sys.stderr)
        return 2
    try:
        docs = [json.loads(Path(p).read_text()) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
