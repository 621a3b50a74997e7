"""bench/runs_table.py: the table BENCHMARKS.md quotes is derived from the bench records alone."""

from __future__ import annotations

import json
from pathlib import Path

from ggml_rpc.bench.runs_table import figure_rows, main, table


def _doc(rt_ref: float, rt_up: float, gc_ref: float, gc_up: float, gen: tuple[float, float]) -> dict:
    def fig(key: str, label: str, unit: str, ref: float, up: float, higher: bool) -> dict:
        ratio = up / ref if higher else ref / up  # upstream relative to the reference, as the bench records it
        return {"key": key, "label": label, "unit": unit, "better": "higher" if higher else "lower",
                "results": [{"target": "reference", "median": ref, "ratio": 1.0},
                            {"target": "upstream-7.0.0", "median": up, "ratio": ratio}]}
    return {"server_figures": [fig("round_trips_1cpu", "small round trips, one CPU", "round trips/s", rt_ref, rt_up,
                                   True),
                               fig("graph_compute_10000", "GRAPH_COMPUTE 10,000", "ms", gc_ref, gc_up, False)],
            "generation": [{"model": "bench-f32", "reference_median": gen[0], "upstream_median": gen[1],
                            "ratio": gen[0] / gen[1]}]}


def test_ratios_are_reference_over_upstream_whatever_the_unit() -> None:
    rows = figure_rows(_doc(40_000, 32_000, 4.0, 3.2, (250, 500)))
    assert round(rows["round_trips_1cpu"]["ratio"], 6) == 1.25  # faster reference: above 1
    assert round(rows["graph_compute_10000"]["ratio"], 6) == 0.8  # 4.0 ms against 3.2 ms: 0.8x
    assert rows["generation bench-f32"]["ratio"] == 0.5


def test_the_median_ratio_and_every_run_are_judged(tmp_path: Path) -> None:
    docs = [_doc(40_000, 32_000, 4.0, 3.2, (250, 500)), _doc(30_000, 32_000, 3.0, 3.3, (260, 400)),
            _doc(36_000, 32_000, 3.5, 3.2, (240, 480))]
    text = table(docs)
    rt = next(line for line in text.splitlines() if line.startswith("| small round trips"))
    assert "1.25x | 0.94x | 1.12x | 1.12x" in rt and "met (every run: no)" in rt
    gen = next(line for line in text.splitlines() if "bench-f32" in line)
    assert "**not met**" in gen and "0.50x | 0.65x | 0.50x | 0.50x" in gen
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    assert main(paths) == 0
    assert main([]) == 2
    assert main([str(tmp_path / "missing.json")]) == 2
