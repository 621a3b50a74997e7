"""Which op computed the tensor a read returns: the per-op closeness of a replay.

A replay compares every read of a computed tensor with the recorded one (NMSE for floats).  Attributed to the graph
node that wrote the bytes read, those comparisons say how close the target computes each op to the recorded server:
replaying a session recorded against upstream on the reference server gives the reference's worst NMSE per op for
the very inputs upstream had (upstream's ``test-backend-ops`` reads every node of each case's graph back, so its
sessions cover every op it tests).

Nodes are matched by the recorded address of their data: a read that starts where a node of the last graph keeps its
result is that node's (the last node in graph order when several share an address, as in-place ops do).  Sub-ops
are named as test-backend-ops names them (``SILU``, ``SWIGLU``), not ``UNARY`` / ``GLU``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from ggml_rpc.spec import GgmlOp, GluOp, UnaryOp, op_name, type_name


def _sub_name(enum: type[UnaryOp] | type[GluOp], value: int, parent: str) -> str:
    try:
        return enum(value).name
    except ValueError:
        return f"{parent}_{value}"


def _index(ids: np.ndarray, order: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``ids`` of each of ``wanted`` and whether it is there at all."""
    pos = np.minimum(np.searchsorted(ids, wanted, sorter=order), len(ids) - 1)
    at = order[pos]
    return at, ids[at] == wanted


def ops_by_address(tensors: np.ndarray, nodes: np.ndarray) -> dict[int, tuple[str, str]]:
    """Recorded data address -> (op, type of its source 0) of the node computed there, for one GRAPH_COMPUTE's
    ``tensors`` (the structured array the decoder gives) and ``nodes`` (their ids, in graph order)."""
    nodes = np.asarray(nodes, dtype=np.uint64)
    if not len(nodes) or not len(tensors):
        return {}
    ids = tensors["id"]
    order = np.argsort(ids, kind="stable")
    at, found = _index(ids, order, nodes)
    at = at[found]
    ops = tensors["op"][at].astype(np.int64)
    computed = ops != int(GgmlOp.NONE)
    at, ops = at[computed], ops[computed]
    subs = tensors["op_params"][at, 0].astype(np.int64)
    labels = {}
    for op, sub in set(zip(ops.tolist(), subs.tolist(), strict=True)):
        if op == int(GgmlOp.UNARY):
            labels[op, sub] = _sub_name(UnaryOp, sub, "UNARY")
        elif op == int(GgmlOp.GLU):
            labels[op, sub] = _sub_name(GluOp, sub, "GLU")
        else:
            labels[op, sub] = op_name(op)
    names = [labels[key] for key in zip(ops.tolist(), subs.tolist(), strict=True)]
    # Source 0's type (the weights of a MUL_MAT, the rows of a GET_ROWS): closeness often depends on it.
    src0 = tensors["src"][at, 0]
    where, known = _index(ids, order, src0)
    types = [type_name(int(t)) if k else "-" for t, k in zip(tensors["type"][where].tolist(), known.tolist(),
                                                              strict=True)]
    # later nodes win a shared address
    return dict(zip(tensors["data"][at].tolist(), zip(names, types, strict=True), strict=True))


class GraphOps:
    """The ops of a connection's last graph, by address (a GRAPH_RECOMPUTE runs the stored graph again)."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[str, str]] = {}

    def graph(self, fields: Mapping[str, Any]) -> None:
        tensors, nodes = fields.get("tensors"), fields.get("nodes")
        if isinstance(tensors, np.ndarray) and tensors.dtype.names and {"op", "src", "type"} <= set(
                tensors.dtype.names) and nodes is not None:
            self._at = ops_by_address(tensors, np.asarray(nodes))

    def read_op(self, fields: Mapping[str, Any]) -> tuple[str, str] | None:
        """(op, source 0's type) of the node whose result a read (its request's recorded ``fields``: tensor,
        offset) starts at, if any."""
        t = fields.get("tensor")
        return None if t is None else self._at.get(int(t["data"]) + int(fields.get("offset", 0)))


def merge_by_op(into: dict[str, dict[str, Any]], other: Mapping[str, Mapping[str, Any]]) -> None:
    """Add another report's per-op figures (reads counted, worst NMSE kept)."""
    for op, fig in other.items():
        mine = into.setdefault(op, {"reads": 0, "worst_nmse": 0.0, "by_src0_type": {}})
        mine["reads"] += fig["reads"]
        mine["worst_nmse"] = max(mine["worst_nmse"], fig["worst_nmse"])
        for key in ("exact_reads", "exact_differ"):
            if key in fig:
                mine[key] = mine.get(key, 0) + fig[key]
        for ty, sub in fig.get("by_src0_type", {}).items():
            s = mine["by_src0_type"].setdefault(ty, {"reads": 0, "worst_nmse": 0.0})
            s["reads"] += sub["reads"]
            s["worst_nmse"] = max(s["worst_nmse"], sub["worst_nmse"])
