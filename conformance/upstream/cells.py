"""What an interop row is and what it gives: a row (ID, title, versions, the function that runs it), its cell
(status, one-line detail, figures) and the result kept for the reports.  The matrix and the row families
(:mod:`.split_rows`, :mod:`.backend_ops_rows`) share these (and :class:`.workspace.Workspace`), so none of them
imports another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, UNSUPPORTED = "pass", "fail", "unsupported"


@dataclass
class Cell:
    status: str
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    id: str
    title: str
    proto: str
    run: Callable[[], Cell]


@dataclass
class RowResult:
    id: str
    title: str
    proto: str
    status: str
    detail: str
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)


__all__ = ["FAIL", "PASS", "UNSUPPORTED", "Cell", "Row", "RowResult"]
