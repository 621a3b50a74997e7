"""Runs of consecutive float32 ADD/SUB/MUL/DIV nodes, each node an elementwise loop, computed by one compiled call.

A prepared binary node is one numpy call (:func:`.elementwise._prepare_binary`), about a quarter of a microsecond
even for a few values: a graph of thousands of small nodes (a chain of 10,000 ADDs, a model's many small
residual and scale nodes) spends its time calling numpy.  Where :func:`fuse` finds a run of such steps whose
operands are plain float32 memory, it replaces them with one step that walks a table of (op, source 0, source 1,
result, size, source 1 row length) and computes every node in order, as the separate calls would: the same IEEE
float32 operation per value (no fast-math), results written before the next node reads them.

Only what the loop computes exactly as numpy's call does is fused: source 0 and the result contiguous and of the
same shape, source 1 contiguous with the same shape or one contiguous row repeated over every row, and each source
either the result's very memory (in place) or apart from it (numpy copies overlapping operands first; the loop
would not).  Addresses are those of views the plan keeps for as long as it lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The ufuncs a run may hold, with their code in the table.
OPS: dict[Any, int] = {np.add: 0, np.subtract: 1, np.multiply: 2, np.divide: 3}
#: Shorter runs stay separate numpy calls (one compiled call costs about as much as a few numpy ones).
MIN_RUN = 8

_F32 = np.dtype(np.float32)


def _span(a: np.ndarray) -> tuple[int, int]:
    start = int(a.__array_interface__["data"][0])
    return start, start + a.nbytes


def _apart_or_same(x: tuple[int, int], out: tuple[int, int]) -> bool:
    return x == out or x[1] <= out[0] or out[1] <= x[0]


def _row(args: tuple[Any, ...]) -> tuple[int, int, int, int, int] | None:
    """(source 0, source 1, result addresses, size, source 1 row length) of one prepared binary step, or None when
    the loop would not compute it exactly as its numpy call does."""
    if len(args) != 3:
        return None
    a, b, out = args
    if not all(isinstance(x, np.ndarray) and x.dtype == _F32 for x in (a, b, out)):
        return None
    if not (a.flags.c_contiguous and out.flags.c_contiguous) or a.shape != out.shape or out.size == 0:
        return None
    if b.flags.c_contiguous and b.shape == out.shape:
        nb, b_span = out.size, _span(b)
    else:
        # One row broadcast over all the others: zero strides everywhere but the last dim, which is contiguous.
        if b.ndim == 0 or b.strides[-1] != 4 or any(s != 0 for s in b.strides[:-1]) or b.shape[-1] != out.shape[-1]:
            return None
        nb = b.shape[-1]
        start = int(b.__array_interface__["data"][0])
        b_span = (start, start + 4 * nb)
    a_span, out_span = _span(a), _span(out)
    if not (_apart_or_same(a_span, out_span) and _apart_or_same(b_span, out_span)):
        return None
    if nb != out.size and b_span == out_span:  # a row of the result read while the result is written
        return None
    return a_span[0], b_span[0], out_span[0], out.size, nb


def _run(table: np.ndarray, keep: tuple[np.ndarray, ...]) -> None:
    from .fused_loop import run_binary

    run_binary(table)


Step = tuple[Callable[..., Any], tuple[Any, ...]]


def fuse(steps: Sequence[Step], nodes: Sequence[Any], kinds: Sequence[str]) -> tuple[list[Step], list[Any],
                                                                                       list[str]]:
    """``steps`` (with their nodes and kinds) with every run of at least :data:`MIN_RUN` fusable binary steps
    replaced by one step (kind "fused", the run's first node)."""
    rows = [_row(args) if kinds[i] == "prepared" and fn in OPS else None for i, (fn, args) in enumerate(steps)]
    out_steps: list[Step] = []
    out_nodes: list[Any] = []
    out_kinds: list[str] = []
    i = 0
    while i < len(steps):
        end = i
        while end < len(steps) and rows[end] is not None:
            end += 1
        if end - i >= MIN_RUN:
            table = np.array([(OPS[steps[t][0]], *rows[t]) for t in range(i, end)], dtype=np.int64)
            keep = tuple(x for t in range(i, end) for x in steps[t][1])  # the views whose memory the table names
            out_steps.append((_run, (table, keep)))
            out_nodes.append(nodes[i])
            out_kinds.append("fused")
            i = end
            continue
        for t in range(i, max(end, i + 1)):  # too short a run (or no run): the steps as they were
            out_steps.append(steps[t])
            out_nodes.append(nodes[t])
            out_kinds.append(kinds[t])
        i = max(end, i + 1)
    return out_steps, out_nodes, out_kinds
