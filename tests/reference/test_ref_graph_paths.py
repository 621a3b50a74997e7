"""build_graph's vectorised paths agree with upstream's walk, rule by rule.

build_graph finds the reached tensors level by level with numpy (row by row once a level is narrow), checks them
all at once, and only when a rule is broken walks the graph in upstream's order to name the first offender.  A
plain model written here (a depth-first walk from the nodes in order, then each rule over the rows in walk order)
is the oracle: on random graphs, wide and deep, with missing references, bad types, stray data pointers and
unknown buffers, both must refuse the same tensor for the same rule, or build the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from ggml_rpc.reference.graph import GraphError, GraphTensor, build_graph
from ggml_rpc.spec import GGML_TYPE_COUNT, NATIVE_CALLBACK_OPS, TENSOR_DTYPE, TYPES, GgmlOp, ggml_nbytes


@dataclass
class FakeBuffer:
    base: int
    size: int
    memory: np.ndarray


BUFFERS = {
    0xA1: FakeBuffer(0x10_0000, 4096, np.zeros(4096, np.uint8)),
    0xB2: FakeBuffer(0x20_0000, 1024, np.zeros(1024, np.uint8)),
}
UNKNOWN = 0xDEAD
REMOVED = next(t for t in range(GGML_TYPE_COUNT) if TYPES[t].removed)


def _model(nodes: list[int], rows: list[dict]) -> tuple[str, object]:
    """("error", (rule, id)) or ("ok", (reached ids in walk order, {id: (src ids, view_src id)}, used handles))."""
    first: dict[int, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(r["id"], i)
    for k, nid in enumerate(nodes):
        if nid == 0:
            return "error", ("null node", k)
        if nid not in first:
            return "error", ("missing node", k)
    order: list[int] = []
    seen: set[int] = set()
    stack = [first[n] for n in reversed(nodes)]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        order.append(i)
        refs = [*rows[i]["src"], rows[i]["view_src"]]
        for ref in refs:
            if ref == 0:
                continue
            if ref not in first:
                return "error", ("missing ref", rows[i]["id"])
            if first[ref] not in seen:
                stack.append(first[ref])
    rules = [
        ("type", lambda r: r["type"] >= GGML_TYPE_COUNT),
        ("removed", lambda r: TYPES[r["type"]].removed),
        ("orphan", lambda r: BUFFERS.get(r["buffer"]) is None and r["data"] != 0),
        ("outside", lambda r: (b := BUFFERS.get(r["buffer"])) is not None
         and not (b.base <= r["data"] and r["data"] + ggml_nbytes(r["type"], r["ne"], r["nb"]) <= b.base + b.size)),
    ]
    for rule, broken in rules:
        for i in order:
            if broken(rows[i]):
                return "error", (rule, rows[i]["id"])
    for k, nid in enumerate(nodes):
        if rows[first[nid]]["op"] in NATIVE_CALLBACK_OPS:
            return "error", ("callback", k)
    links = {rows[i]["id"]: ([r if r else None for r in rows[i]["src"]], rows[i]["view_src"] or None)
             for i in order}
    used = {rows[i]["buffer"] for i in order if rows[i]["buffer"] in BUFFERS}
    return "ok", ([rows[i]["id"] for i in order], links, used)


def _classify(exc: GraphError) -> tuple[str, object]:
    msg = str(exc)
    word = msg.split()
    if "has id 0" in msg:
        return "null node", int(word[1])
    if "is not among the graph's tensors" in msg:
        return "missing node", int(word[1])
    tid = int(word[1], 16)
    for rule, text in (("missing ref", "refers to id"), ("type", "not a ggml type"), ("removed", "removed type"),
                       ("orphan", "no buffer but data"), ("outside", "lies outside")):
        if text in msg:
            return rule, tid
    if "native function pointers" in msg:
        return "callback", int(word[1])
    raise AssertionError(msg)


def _random_graph(rng: np.random.Generator, n: int, n_nodes: int, faults: float) -> tuple[list[int], list[dict]]:
    """A random graph; each kind of fault is injected (1 to 3 times, at random rows) with probability ``faults``."""
    ids = rng.permutation(np.arange(1, 3 * n + 1))[:n].tolist()
    if n > 3 and rng.random() < 0.3:
        ids[-1] = ids[0]  # a duplicate id: the first row carrying it wins
    rows = []
    for i, tid in enumerate(ids):
        src = [0] * 10
        # Mostly references to earlier rows (chains and fans), sometimes to any row (cycles).
        for s in range(int(rng.integers(0, 4))):
            src[s] = ids[int(rng.integers(0, i))] if i and rng.random() < 0.9 else ids[int(rng.integers(0, n))]
        view_src = ids[int(rng.integers(0, n))] if rng.random() < 0.2 else 0
        handle = [0xA1, 0xA1, 0xB2, 0, UNKNOWN][int(rng.integers(0, 5))]
        buf = BUFFERS.get(handle)
        data = 0 if buf is None else buf.base + 16 * int(rng.integers(0, buf.size // 16 - 1))
        rows.append({"id": tid, "type": 0, "buffer": handle, "data": data, "src": src, "view_src": view_src,
                     "op": int(GgmlOp.ADD), "ne": (4, 1, 1, 1), "nb": (4, 16, 16, 16)})
    nodes = [ids[int(k)] for k in rng.integers(0, n, n_nodes)]

    def inject(fault: str, r: dict) -> None:
        if fault == "missing":
            r["src"][int(rng.integers(0, 10))] = int(rng.integers(10_000, 20_000))
        elif fault == "view_missing":
            r["view_src"] = int(rng.integers(10_000, 20_000))
        elif fault == "type":
            r["type"] = GGML_TYPE_COUNT + int(rng.integers(0, 100))
        elif fault == "removed":
            r["type"] = REMOVED
        elif fault == "orphan":
            r["buffer"], r["data"] = [0, UNKNOWN][int(rng.integers(0, 2))], 0x1234
        elif fault == "outside":
            buf = BUFFERS[0xB2]
            r["buffer"], r["data"] = 0xB2, buf.base + buf.size - 4 * int(rng.integers(0, 4))
        elif fault == "callback":
            r["op"] = int(rng.choice(sorted(NATIVE_CALLBACK_OPS)))
        elif fault == "bad_node":
            nodes[int(rng.integers(0, n_nodes))] = [0, 99_999][int(rng.integers(0, 2))]

    for fault in ("missing", "view_missing", "type", "removed", "orphan", "outside", "callback", "bad_node"):
        if rng.random() < faults:
            for _ in range(int(rng.integers(1, 4))):
                inject(fault, rows[int(rng.integers(0, n))])
    return nodes, rows


def _array(rows: list[dict]) -> np.ndarray:
    arr = np.zeros(len(rows), dtype=TENSOR_DTYPE)
    for i, r in enumerate(rows):
        for key in ("id", "type", "buffer", "data", "src", "view_src", "op", "ne", "nb"):
            arr[key][i] = r[key]
    return arr


def _links(nodes: list[GraphTensor]) -> tuple[dict, set[int]]:
    """Every tensor the built nodes reach: {id: (src ids, view_src id)} (ids name the first row, as built)."""
    out: dict[int, tuple[list[int | None], int | None]] = {}
    stack = list(nodes)
    seen: set[int] = set()
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[t.id] = ([s.id if s is not None else None for s in t.src], t.view_src.id if t.view_src else None)
        stack.extend(s for s in (*t.src, t.view_src) if s is not None)
    return out, seen


@pytest.mark.parametrize(("n", "n_nodes", "faults"), [(8, 3, 0.0), (8, 3, 0.3), (60, 50, 0.15), (200, 150, 0.1),
                                                      (200, 5, 0.1), (400, 300, 0.05), (600, 500, 0.05)])
def test_random_graphs_agree_with_the_walk_model(n, n_nodes, faults) -> None:
    rng = np.random.default_rng(n * 1000 + n_nodes)
    outcomes = set()
    for _ in range(60):
        nodes, rows = _random_graph(rng, n, n_nodes, faults)
        kind, want = _model(nodes, rows)
        try:
            g = build_graph(np.array(nodes, dtype=np.uint64), _array(rows), BUFFERS)
        except GraphError as exc:
            assert kind == "error", f"refused {exc}; the model builds it"
            assert _classify(exc) == want
            outcomes.add(want[0])
            continue
        assert kind == "ok", f"built; the model refuses {want}"
        order, links, used = want
        got, _objects = _links(g.nodes)
        assert got == links and g.n_tensors == len(order) and g.buffers == used
        assert [t.id for t in g.nodes] == nodes
        outcomes.add("ok")
    assert outcomes  # every case ran
    if faults == 0:
        assert outcomes == {"ok"}


def test_wide_levels_then_a_long_narrow_tail_are_all_reached() -> None:
    # 300 nodes (a wide first level) all reading the head of a 5,000-long chain of views: the walk switches from
    # numpy levels to row by row, and must still reach every tensor once.
    width, depth = 300, 5000
    n = width + depth
    arr = np.zeros(n, dtype=TENSOR_DTYPE)
    arr["id"] = np.arange(1, n + 1)
    arr["ne"] = 1
    arr["nb"] = 4
    arr["op"][:width] = GgmlOp.ADD
    arr["src"][:width, 0] = width + 1  # every node reads the chain's head
    arr["view_src"][width : n - 1] = np.arange(width + 2, n + 1)  # row k views row k + 1
    g = build_graph(arr["id"][:width].copy(), arr, {})
    assert g.n_tensors == n
    t = g.nodes[0].src[0]
    steps = 0
    while t.view_src is not None:
        t = t.view_src
        steps += 1
    assert steps == depth - 1 and t.id == n


def test_a_missing_reference_deep_in_a_narrow_tail_is_named() -> None:
    width, depth = 300, 300
    n = width + depth
    arr = np.zeros(n, dtype=TENSOR_DTYPE)
    arr["id"] = np.arange(1, n + 1)
    arr["ne"] = 1
    arr["nb"] = 4
    arr["src"][:width, 0] = width + 1
    arr["src"][width : n - 1, 0] = np.arange(width + 2, n + 1)
    arr["src"][n - 1, 3] = 77_777  # the chain's last tensor refers to an id nobody carries
    with pytest.raises(GraphError, match=f"tensor {n:#x} refers to id {77_777:#x}"):
        build_graph(arr["id"][:width].copy(), arr, {})


def test_the_first_rule_in_walk_order_is_named_when_several_are_broken() -> None:
    # Rows in the array: 1 (node), 2, 3.  Walk order from node 1: 1, 3 (src 0), 2 (src 1 of 3).  Rows 2 and 3 both
    # lie outside their buffer: row 3 comes first in the walk, row 2 first in the array.
    buf = BUFFERS[0xA1]
    rows = [
        {"id": 1, "src": [3] + [0] * 9},
        {"id": 2, "data": buf.base + buf.size},
        {"id": 3, "data": buf.base + buf.size, "src": [0, 2] + [0] * 8},
    ]
    full = [{"type": 0, "buffer": 0xA1, "data": buf.base, "src": [0] * 10, "view_src": 0, "op": int(GgmlOp.ADD),
             "ne": (4, 1, 1, 1), "nb": (4, 16, 16, 16)} | r for r in rows]
    with pytest.raises(GraphError, match="tensor 0x3 data"):
        build_graph(np.array([1], dtype=np.uint64), _array(full), BUFFERS)
