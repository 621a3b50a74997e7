"""The graph the reference server rebuilds from GRAPH_COMPUTE and hands to the executor.

A :class:`GraphTensor` is one rpc_tensor with its references resolved (sources and view source are other
GraphTensors) and its memory located: ``buffer`` is the whole writable memory of the server buffer the tensor
lives in and ``offset`` is ``data - base`` inside it.  The server checks, before the executor ever sees a tensor,
that ``[offset, offset + nbytes)`` lies inside ``buffer``; the executor checks what each op needs beyond that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from ggml_rpc.spec import GGML_TYPE_COUNT, NATIVE_CALLBACK_OPS, TYPES, ggml_nbytes, op_name, tensor_name, type_name


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
    src: list[GraphTensor | None] = field(default_factory=lambda: [None] * 10)
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
    """A GRAPH_COMPUTE the server refuses before execution; the message names the rule that was broken."""


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


# Per-type geometry as arrays, so a whole graph's byte sizes are computed in one vectorised pass.
_BLCK = np.array([TYPES[t].blck for t in range(GGML_TYPE_COUNT)], dtype=np.uint64)
_TSIZE = np.array([TYPES[t].size for t in range(GGML_TYPE_COUNT)], dtype=np.uint64)
# Above this the exact (Python integer) size is computed instead of the uint64 one, which could wrap.
_EXACT_ABOVE = float(1 << 62)


def _nbytes(types: np.ndarray, ne32: np.ndarray, nb32: np.ndarray) -> list[int]:
    """ggml_nbytes of many tensors (valid types only), exact even where 64-bit arithmetic would wrap."""
    if len(types) == 0:
        return []
    ne = ne32.astype(np.uint64)
    nb = nb32.astype(np.uint64)
    blck = _BLCK[types]
    tsize = _TSIZE[types]
    empty = (ne == 0).any(axis=1)
    ne_m1 = np.where(empty[:, None], np.uint64(0), ne - np.uint64(1))
    tail = (ne_m1[:, 1:] * nb[:, 1:]).sum(axis=1)
    blocked = blck > 1
    head = np.where(blocked, ne[:, 0] * nb[:, 0] // np.maximum(blck, np.uint64(1)), tsize + ne_m1[:, 0] * nb[:, 0])
    total = head + tail
    total[empty] = 0
    out = total.tolist()
    estimate = ne_m1.astype(np.float64) * nb.astype(np.float64)
    for k in np.flatnonzero(estimate.sum(axis=1) + ne[:, 0].astype(np.float64) * nb[:, 0] > _EXACT_ABOVE).tolist():
        out[k] = ggml_nbytes(int(types[k]), ne32[k].tolist(), nb32[k].tolist())
    return out


def build_graph(node_ids: np.ndarray, tensors: np.ndarray, buffers: Mapping[int, BufferLike]) -> BuiltGraph:
    """Rebuild a GRAPH_COMPUTE graph as upstream does, refusing (GraphError) what upstream crashes on.

    ``node_ids`` and ``tensors`` are the decoded GRAPH_COMPUTE fields; ``buffers`` maps this connection's buffer
    handles to buffers.  Only tensors reachable from the nodes (through ``src`` and ``view_src``) are built and
    validated, as upstream does.  Duplicate ids: the first tensor with an id wins.  Cycles terminate (every id is
    built once and referenced afterwards); the walk is iterative, so chain depth is bounded only by the graph.
    """
    ids = tensors["id"].tolist()
    n = len(ids)
    index = dict(zip(reversed(ids), range(n - 1, -1, -1), strict=True))  # first occurrence wins
    src_rows = tensors["src"].tolist()
    view_srcs = tensors["view_src"].tolist()
    node_list = node_ids.tolist()

    # 1. Which tensors the nodes reach, each once.
    order: list[int] = []
    seen: set[int] = set()
    for k, nid in enumerate(node_list):
        if nid == 0:
            raise GraphError(f"node {k} has id 0 (a null node; upstream dereferences it)")
        if nid not in index:
            raise GraphError(f"node {k} id {nid:#x} is not among the graph's tensors")
        if nid in seen:
            continue
        stack = [nid]
        while stack:
            tid = stack.pop()
            if tid in seen:
                continue
            i = index[tid]
            seen.add(tid)
            order.append(i)
            for ref in (*src_rows[i], view_srcs[i]):
                if ref and ref not in seen:
                    if ref not in index:
                        raise GraphError(f"tensor {tid:#x} refers to id {ref:#x}, which is not among the tensors")
                    stack.append(ref)

    # 2. Validate and build them.
    sel = np.array(order, dtype=np.intp)
    rows = tensors[sel]
    types = rows["type"]
    bad = np.flatnonzero(types >= GGML_TYPE_COUNT)
    if len(bad):
        k = int(bad[0])
        raise GraphError(f"tensor {ids[order[k]]:#x} has type {int(types[k])}, not a ggml type")
    removed = np.flatnonzero(_BLCK[types] == 0)
    if len(removed):
        k = int(removed[0])
        raise GraphError(f"tensor {ids[order[k]]:#x} has removed type {type_name(int(types[k]))}")
    ops = rows["op"].tolist()
    nbytes = _nbytes(types, rows["ne"], rows["nb"])
    type_l = types.tolist()
    ne_l = rows["ne"].tolist()
    nb_l = rows["nb"].tolist()
    flags_l = rows["flags"].tolist()
    bufs_l = rows["buffer"].tolist()
    data_l = rows["data"].tolist()
    voffs_l = rows["view_offs"].tolist()
    names_l = rows["name"].tolist()
    use_l = rows["use_count"].tolist()
    op_params = np.ascontiguousarray(rows["op_params"])

    built: dict[int, GraphTensor] = {}
    used: set[int] = set()
    views: dict[int, memoryview] = {}
    for k, i in enumerate(order):
        tid = ids[i]
        handle = bufs_l[k]
        buf = buffers.get(handle) if handle else None
        data = data_l[k]
        size = nbytes[k]
        mem = None
        offset = 0
        if buf is None:
            if data != 0:
                raise GraphError(f"tensor {tid:#x} has no buffer but data {data:#x} (invalid data pointer)")
        else:
            if data < buf.base or data + size > buf.base + buf.size:
                raise GraphError(f"tensor {tid:#x} data [{data:#x}, +{size}) lies outside its buffer "
                                 f"[{buf.base:#x}, +{buf.size})")
            mem = views.get(handle)
            if mem is None:
                mem = views[handle] = memoryview(buf.memory)
            offset = data - buf.base
            used.add(handle)
        built[tid] = GraphTensor(
            id=tid,
            type=type_l[k],
            ne=tuple(ne_l[k]),
            nb=tuple(nb_l[k]),
            op=ops[k],
            op_params=op_params[k],
            flags=flags_l[k],
            view_offs=voffs_l[k],
            data=data,
            name=tensor_name(names_l[k]),
            use_count=use_l[k],
            buffer=mem,
            offset=offset,
            nbytes=size,
        )

    # 3. Resolve references (every referenced id was reached in step 1).
    for i in order:
        t = built[ids[i]]
        refs = src_rows[i]
        if any(refs):
            t.src = [built[r] if r else None for r in refs]
        if view_srcs[i]:
            t.view_src = built[view_srcs[i]]

    nodes = [built[nid] for nid in node_list]
    for k, t in enumerate(nodes):
        if t.op in NATIVE_CALLBACK_OPS:
            raise GraphError(f"node {k} ({t.name or hex(t.id)}) is a {op_name(t.op)} op, whose op_params hold "
                             "native function pointers: never executed")
    return BuiltGraph(nodes, frozenset(used), len(order))
