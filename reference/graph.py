"""The graph the reference server rebuilds from GRAPH_COMPUTE and hands to the executor.

A :class:`GraphTensor` is one rpc_tensor with its references resolved (sources and view source are other
GraphTensors) and its memory located: ``buffer`` is the whole writable memory of the server buffer the tensor
lives in and ``offset`` is ``data - base`` inside it.  The server checks, before the executor ever sees a tensor,
that ``[offset, offset + nbytes)`` lies inside ``buffer``; the executor checks what each op needs beyond that.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import numpy as np
from ggml_rpc.spec import NATIVE_CALLBACK_OPS, op_name, type_name
from ggml_rpc.spec.conditions import (
    block_size,
    first_rows,
    null_nodes,
    partial_blocks,
    removed_types,
    unknown_types,
)
from ggml_rpc.spec.facts import ggml_nbytes_many
from ggml_rpc.spec.tensor import GGML_MAX_SRC


@dataclass(slots=True, eq=False)
class GraphTensor:
    """One tensor of a rebuilt graph."""

    id: int
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int
    #: The 16 raw i32 op parameters (read floats with ``op_params.view(np.float32)``).
    op_params: np.ndarray
    flags: int
    src: list[GraphTensor | None] = field(default_factory=lambda: [None] * GGML_MAX_SRC)
    view_src: GraphTensor | None = None
    view_offs: int = 0
    #: Absolute address the client gave (0 when the tensor has no server memory).
    data: int = 0
    name: str = ""
    use_count: int = 0
    #: Whole memory of the tensor's server buffer (writable), or None for a tensor without a buffer.
    buffer: memoryview | None = None
    #: Byte offset of the tensor's first byte inside ``buffer``.
    offset: int = 0
    #: ggml_nbytes of the tensor as sent (already checked against the buffer).
    nbytes: int = 0


class ExecutorError(Exception):
    """A graph the executor refuses to run: unsupported op or type, or inputs that break the op's rules.

    The message names the op, the types and the shapes; the server closes the connection with it.
    """


class GraphError(Exception):
    """A GRAPH_COMPUTE the server refuses before execution; the message names the rule that was broken, ``rule`` the
    rule table's id when the refusal is one of the table's."""

    def __init__(self, message: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule


class BufferLike(Protocol):
    """What graph building needs of a server buffer."""

    base: int
    size: int
    memory: np.ndarray


@dataclass(slots=True, eq=False)
class BuiltGraph:
    """The nodes of a rebuilt graph in execution order, and the buffer handles its tensors use."""

    nodes: list[GraphTensor]
    buffers: frozenset[int]
    n_tensors: int
    #: Non-zero buffer handles the graph's tensors name that were not buffers when it was built (those tensors were
    #: built as tensors without memory): the graph stays what a rebuild would give only while they stay unknown.
    unknown: frozenset[int] = frozenset()
    #: What the server's executor prepared for running this graph again (made on the first run, kept with the
    #: graph, so it goes when the graph goes: a FREE_BUFFER of one of ``buffers`` drops both).
    plan: Any = None
    #: The GRAPH_COMPUTE payload the server built this graph from (to recognise the same graph sent again).
    source: Any = None


def _inner_nul(raw: np.ndarray) -> bool:
    """Whether some name has a NUL before a non-NUL byte (text after it is not part of the name)."""
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(len(raw), -1)
    return bool(((b[:, :-1] == 0) & (b[:, 1:] != 0)).any())


def _names(raw: np.ndarray) -> list[str]:
    """Tensor names as upstream copies them (up to the first NUL), decoded in one call for the whole array."""
    items = raw.tolist()  # numpy drops the trailing NULs
    if len(raw) and _inner_nul(raw):
        items = [r.split(b"\0", 1)[0] for r in items]
    if not items:
        return []
    # NUL cannot occur inside the items now, so it separates them safely (and ends any broken UTF-8 sequence).
    return b"\0".join(items).decode("utf-8", "replace").split("\0")


@contextmanager
def paused_collections() -> Iterator[None]:
    """No garbage collection inside: for code making thousands of objects that are all kept (each collection
    pass would only walk them again)."""
    collect = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collect:
            gc.enable()


_CALLBACK_OPS = np.array(sorted(int(op) for op in NATIVE_CALLBACK_OPS), dtype=np.uint32)
# Breadth-first levels are walked with numpy while they are at least this wide, then row by row (a long chain of
# views would otherwise cost one numpy pass per link).
_WIDE = 128


def _walk(node_rows: list[int], starts: list[int], tgt: list[int], ids: np.ndarray, e_id: np.ndarray) -> list[int]:
    """The rows the nodes reach, each once, in upstream's order (depth first, nodes in order), refusing the first
    reference to a missing id that walk meets."""
    reached = bytearray(len(starts) - 1)
    order: list[int] = []
    stack = node_rows[::-1]
    while stack:
        i = stack.pop()
        if reached[i]:
            continue
        reached[i] = 1
        order.append(i)
        for j in range(starts[i], starts[i + 1]):
            r = tgt[j]
            if r < 0:
                raise GraphError(f"tensor {int(ids[i]):#x} refers to id {int(e_id[j]):#x}, which is not among the "
                                 "tensors")
            if not reached[r]:
                stack.append(r)
    return order


def _reach(node_rows: np.ndarray, starts: np.ndarray, e_tgt: np.ndarray) -> np.ndarray | None:
    """The rows the nodes reach, sorted, or None when one of them refers to a missing id (``_walk`` names it)."""
    seen = np.zeros(len(starts) - 1, dtype=bool)
    frontier = np.unique(node_rows)
    seen[frontier] = True
    while len(frontier) >= _WIDE:
        lo = starts[frontier]
        count = starts[frontier + 1] - lo
        total = int(count.sum())
        if total == 0:
            return np.flatnonzero(seen)
        edges = np.arange(total) + np.repeat(lo - (np.cumsum(count) - count), count)
        tgt = e_tgt[edges]
        if tgt.min() < 0:
            return None
        frontier = np.unique(tgt[~seen[tgt]])
        seen[frontier] = True
    if len(frontier):
        starts_l, tgt_l = starts.tolist(), e_tgt.tolist()
        stack = frontier.tolist()
        while stack:
            i = stack.pop()
            for j in range(starts_l[i], starts_l[i + 1]):
                r = tgt_l[j]
                if r < 0:
                    return None
                if not seen[r]:
                    seen[r] = True
                    stack.append(r)
    return np.flatnonzero(seen)


@dataclass(slots=True)
class _Checked:
    """The located rows of a graph: everything the objects are built from."""

    rows: np.ndarray
    nbytes: list[int]
    data: list[int]
    offsets: list[int]
    memories: list[memoryview | None]
    used: set[int]
    unknown: set[int]


def _check(rows: np.ndarray, buffers: Mapping[int, BufferLike]) -> _Checked:
    """Validate ``rows`` (vectorised) and locate them in their buffers; the first bad row is refused."""
    types = rows["type"]
    bad = np.flatnonzero(unknown_types(types))
    if len(bad):
        k = int(bad[0])
        raise GraphError(f"tensor {int(rows['id'][k]):#x} has type {int(types[k])}, not a ggml type", "TENSOR-TYPE")
    removed = np.flatnonzero(removed_types(types))
    if len(removed):
        # The table's TENSOR-REMOVED-TYPE reads single-tensor requests only: no rule id here.
        k = int(removed[0])
        raise GraphError(f"tensor {int(rows['id'][k]):#x} has removed type {type_name(int(types[k]))}")
    partial = np.flatnonzero(partial_blocks(types, rows["ne"][:, 0]))
    if len(partial):
        # #25288: a row that ends inside a block; sizes and kernels assume whole blocks.
        k = int(partial[0])
        raise GraphError(f"tensor {int(rows['id'][k]):#x} ne[0] = {int(rows['ne'][k][0])} is not a multiple of "
                         f"{type_name(int(types[k]))}'s block size {block_size(int(types[k]))}")
    nbytes, nbytes_u = ggml_nbytes_many(types, rows["ne"], rows["nb"])
    handles = rows["buffer"]
    data = rows["data"]
    data_l = data.tolist()
    uniq, inverse = np.unique(handles, return_inverse=True)
    inverse = inverse.reshape(-1)
    base_u = np.zeros(len(uniq), dtype=np.uint64)
    size_u = np.zeros(len(uniq), dtype=np.uint64)
    known_u = np.zeros(len(uniq), dtype=bool)
    mems: list[memoryview | None] = []
    used: set[int] = set()
    unknown: set[int] = set()
    for u, handle in enumerate(uniq.tolist()):
        buf = buffers.get(handle) if handle else None
        mems.append(memoryview(buf.memory) if buf is not None else None)
        if buf is not None:
            base_u[u], size_u[u], known_u[u] = buf.base, buf.size, True
            used.add(handle)
        elif handle:
            unknown.add(handle)
    known = known_u[inverse]
    orphan = np.flatnonzero(~known & (data != 0))
    if len(orphan):
        k = int(orphan[0])
        raise GraphError(f"tensor {int(rows['id'][k]):#x} has no buffer but data {data_l[k]:#x} "
                         "(invalid data pointer)")
    base, size = base_u[inverse], size_u[inverse]
    rel = data - base  # wraps where data < base; those rows fail the first test below
    inside = (data >= base) & (nbytes_u <= size) & (rel <= size - nbytes_u)
    outside = np.flatnonzero(known & ~inside)
    if len(outside):
        k = int(outside[0])
        raise GraphError(f"tensor {int(rows['id'][k]):#x} data [{data_l[k]:#x}, +{nbytes[k]}) lies outside its "
                         f"buffer [{int(base[k]):#x}, +{int(size[k])})")
    off_l = np.where(known, rel, 0).tolist()
    located = [mems[0]] * len(rows) if len(mems) == 1 else [mems[u] for u in inverse.tolist()]
    return _Checked(rows, nbytes, data_l, off_l, located, used, unknown)


def build_graph(node_ids: np.ndarray, tensors: np.ndarray, buffers: Mapping[int, BufferLike]) -> BuiltGraph:
    """Rebuild a GRAPH_COMPUTE graph as upstream does, refusing (GraphError) what upstream crashes on.

    ``node_ids`` and ``tensors`` are the decoded GRAPH_COMPUTE fields; ``buffers`` maps this connection's buffer
    handles to buffers.  Only tensors reachable from the nodes (through ``src`` and ``view_src``) are built and
    validated, as upstream does.  Duplicate ids: the first tensor with an id wins.  Cycles terminate (every id is
    built once and referenced afterwards); the walk is iterative, so chain depth is bounded only by the graph.
    References are resolved, checked and linked for the whole array at once (numpy), so per-tensor Python work
    stays small.  Where several rules are broken, the one refused is the first upstream's walk would meet.
    """
    n = len(tensors)
    ids = tensors["id"]
    nodes_u64 = np.asarray(node_ids, dtype=np.uint64)
    # Every reference (the src slots, then view_src in the slot after them) as an edge row -> target row.
    refs = np.concatenate([tensors["src"], tensors["view_src"][:, None]], axis=1)
    e_row, e_slot = np.nonzero(refs)
    e_id = refs[e_row, e_slot]
    both = first_rows(ids, np.concatenate([nodes_u64, e_id]))
    node_rows = both[: len(nodes_u64)]
    e_tgt = both[len(nodes_u64) :]

    zero = np.flatnonzero(null_nodes(nodes_u64))
    missing = np.flatnonzero(node_rows < 0)
    if len(zero) and (not len(missing) or zero[0] <= missing[0]):
        raise GraphError(f"node {int(zero[0])} has id 0 (a null node; upstream dereferences it)", "GRAPH-NULL-NODE")
    if len(missing):
        k = int(missing[0])
        raise GraphError(f"node {k} id {int(nodes_u64[k]):#x} is not among the graph's tensors", "GRAPH-NODE-UNKNOWN")

    # 1. Which rows the nodes reach (edges are sorted by row: each row's edges are one slice of them).
    starts = np.searchsorted(e_row, np.arange(n + 1))

    def walk() -> list[int]:
        return _walk(node_rows.tolist(), starts.tolist(), e_tgt.tolist(), ids, e_id)

    sel = _reach(node_rows, starts, e_tgt)
    if sel is None:
        walk()  # refuses the missing reference upstream's walk meets first
        raise AssertionError("unreachable: a reached row refers to a missing id")

    # 2. Validate the reached rows, vectorised; a broken rule is named as upstream's walk order meets it.
    try:
        checked = _check(tensors if len(sel) == n else tensors[sel], buffers)  # sel is sorted: all rows, in order
    except GraphError:
        _check(tensors[np.array(walk(), dtype=np.intp)], buffers)
        raise

    # 3. Build the objects (column-wise, one map call), then link references (one object-array gather).
    rows = checked.rows
    m = len(sel)
    ne, nb = rows["ne"], rows["nb"]
    with paused_collections():
        built: list[GraphTensor] = list(
            map(
                GraphTensor,
                rows["id"].tolist(),
                rows["type"].tolist(),
                zip(*(ne[:, i].tolist() for i in range(4)), strict=True),
                zip(*(nb[:, i].tolist() for i in range(4)), strict=True),
                rows["op"].tolist(),
                list(np.ascontiguousarray(rows["op_params"])),
                rows["flags"].tolist(),
                repeat(None, m),
                repeat(None, m),
                rows["view_offs"].tolist(),
                checked.data,
                _names(rows["name"]),
                rows["use_count"].tolist(),
                checked.memories,
                checked.offsets,
                checked.nbytes,
            )
        )
        by_row = np.full(n + 1, None, dtype=object)  # row n stands for "no reference"
        by_row[sel] = built
        targets = np.full((n, GGML_MAX_SRC + 1), n, dtype=np.intp)
        targets[e_row, e_slot] = e_tgt  # every target of a reached row is reached (and >= 0)
        linked = by_row[targets[sel]]
        srcs, view_srcs = linked[:, :GGML_MAX_SRC].tolist(), linked[:, GGML_MAX_SRC].tolist()
        for t, sources, view_src in zip(built, srcs, view_srcs, strict=True):
            t.src = sources
            t.view_src = view_src
        nodes: list[GraphTensor] = by_row[node_rows].tolist()

    callbacks = np.flatnonzero((tensors["op"][node_rows][:, None] == _CALLBACK_OPS).any(axis=1))
    if len(callbacks):
        k = int(callbacks[0])
        t = nodes[k]
        raise GraphError(f"node {k} ({t.name or hex(t.id)}) is a {op_name(t.op)} op, whose op_params hold "
                         "native function pointers: never executed")
    return BuiltGraph(nodes, frozenset(checked.used), m, frozenset(checked.unknown))
