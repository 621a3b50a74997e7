"""Terminal and JSON output of ``ggml-rpc bench``: the header, a progress bar while it runs, the final tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .runner import FigureResult, TargetResult
from .server_figures import BenchTarget


def header(console: Console, targets: Sequence[BenchTarget], plan: str) -> None:
    for i, t in enumerate(targets):
        version = ".".join(map(str, t.version)) if t.version else "?"
        role = "baseline" if i == 0 else "target"
        console.print(f"[bold]{t.name}[/bold] {t.address}: protocol {version} ({t.description}; {role})")
    console.print(plan, style="dim")


class BenchProgress:
    """A progress bar with the figure and target being measured (rich hides it where there is no terminal)."""

    def __init__(self, console: Console, total: int) -> None:
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=True)
        self._task = self._progress.add_task("starting", total=total)

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, label: str, target: str, done: int, total: int) -> None:
        self._progress.update(self._task, advance=1, description=f"{label:<40.40} {target:<16.16}")


def fmt(value: float) -> str:
    """Three significant figures, thousands separated."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def cell(r: TargetResult, show_ratio: bool) -> str:
    if r.error is not None:
        return "[red]error[/red]"
    if r.not_applicable is not None:
        return f"n/a: {r.not_applicable}"
    s = r.stats
    if s is None:
        return "-"
    text = f"{fmt(s.median)} ±{s.spread_pct:.0f}%"
    if show_ratio and r.ratio is not None:
        text += f" ({r.ratio:.2f}x)"
    return text


def goal_cell(fr: FigureResult) -> str:
    goal = fr.as_dict()["goal"]
    if goal is None:
        return ""
    mark = {True: "[green]met[/green]", False: "[red]not met[/red]", None: ""}[goal["met"]]
    op = "≥" if goal["op"] == ">=" else "≤"
    return f"{op} {fmt(goal['value'])} {mark}".strip()


def figures_table(title: str, results: Sequence[FigureResult], names: Sequence[str]) -> Table:
    """One row per figure, one column per target: median ±spread (speed relative to the first target)."""
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("unit")
    for i, name in enumerate(names):
        table.add_column(name if i else f"{name} (baseline)", justify="right", overflow="fold")
    table.add_column("goal (reference/kit)")
    many = len(names) > 1
    for fr in results:
        table.add_row(fr.figure.label, fr.figure.unit, *(cell(r, many) for r in fr.results), goal_cell(fr))
    return table


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """The record, in a file or on standard output for ``-`` (the CLI convention)."""
    text = json.dumps(doc, indent=2) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(path).write_text(text, encoding="utf-8")


__all__ = ["BenchProgress", "cell", "figures_table", "fmt", "goal_cell", "header", "write_json"]
