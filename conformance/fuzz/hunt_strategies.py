"""Strategies of the hunt (``ggml-rpc fuzz --hunt``) aimed at upstream's reported bug classes (the checklist in
:mod:`.checklist`, SECURITY.md) and at what its builds were seen to die of.

Each one is a step of a seeded example: deep src chains, node id 0, row indices past the table, size headers of 2^63 and
more, tensors one byte outside their buffer or region, the other major's SET_TENSOR layout, a client that leaves before
its reply, and reads of fresh buffers (info leaks); and upstream's memory-safety bug classes (SECURITY.md): partial
quantisation blocks (C), empty and wrapping sizes and views past their source (B), null and freed buffers in graphs (A),
cyclic graphs (D), kernel bounds driven by op_params and index tensors (E) and CUSTOM ops' function pointers (F).  Every
message goes through the example (model and target, same invariants) like the generic generators' messages.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from ggml_rpc.spec import Command, GgmlOp, GgmlType, TensorFlag
from ggml_rpc.spec.codec import TENSOR_DTYPE

from .class_strategies import (
    block_misaligned,
    custom_op,
    foreign_buffer,
    fresh_buffer,
    graph_structure,
    kernel_bounds,
    size_arithmetic,
)
from .draws import RandomDraw
from .message import FuzzMessage
from .valid_requests import BufferRef, TensorRef

if TYPE_CHECKING:
    from .example import Example
    from .hunt import Hunt

#: The src-chain depth upstream's recursive graph rebuild does not survive (6.0.0 and 7.0.0: 100,000 computes).
DEEP_CHAIN = 300_000
#: Out of 1,000 strategy picks, how many are the (89 MB) deep chain.
DEEP_PER_MILLE = 4
#: Seconds the 89 MB of a deep chain may take to go out and be answered (or closed).
DEEP_WAIT = 30.0
#: Row indices for GET_ROWS past any table the fuzzer builds.
BAD_ROWS = (-1, 8, 9, 1 << 16, 0x7FFFFFFF, -(1 << 31))


Strategy = Callable[["Hunt", "Example", RandomDraw, random.Random], None]


def _tensor(ex: Example, buf: BufferRef, offset: int, ne: tuple[int, ...], type_id: int, tid: int) -> TensorRef:
    from ggml_rpc.spec import make_tensor, tensor_nbytes

    t = make_tensor(id=tid, type=type_id, ne=ne, buffer=buf.handle, data=buf.base + offset)
    ref = TensorRef(t, buf, tensor_nbytes(t))
    ex.scope.all_tensors.append(ref)
    return ref


def deep_chain(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GRAPH_COMPUTE of one node at the end of a src chain of 300,000+ tensors (no buffers, nothing to run)."""
    depth = rng.choice((DEEP_CHAIN, DEEP_CHAIN + 50_000))
    if depth in h.survived_deep:
        # Nothing of the example's state reaches this graph (a connection of its own, no buffers): a target that
        # outlived this depth once outlives it again, and the seconds its 89 MB take go to other strategies.
        STRATEGIES[rng.randrange(len(STRATEGIES))][1](h, ex, d, rng)
        return
    tensors = np.zeros(depth, dtype=TENSOR_DTYPE)
    ids = np.arange(1, depth + 1, dtype=np.uint64) + np.uint64(0x100000)
    tensors["id"] = ids
    tensors["type"] = int(GgmlType.F32)
    tensors["ne"] = (4, 1, 1, 1)
    tensors["nb"] = (4, 16, 16, 16)
    tensors["src"][1:, 0] = ids[:-1]
    msg = FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [int(ids[-1])], "tensors": tensors},
                      broken=f"deep: src chain = {depth}", tags=("deep",))
    # 89 MB are not worth holding in the model's receive buffer in the fuzzer's thread.  The graph goes to the target
    # alone, on a connection of its own that ends right after it; only the target's survival is judged.
    ex.close_current()
    conn = ex.new_ref()
    ex.prepare(conn)
    tconn = ex.tconn
    if ex.inert or tconn is None:
        return
    wire, _ = msg.encode(ex.protocol)
    tconn.timeout = max(tconn.timeout, DEEP_WAIT)
    tconn.send(wire)
    ex.record_sent(msg, wire)
    tconn.shutdown_write()
    tconn.until_closed()
    tconn.close()
    ex.models[conn].close()
    ex.current, ex.tconn = None, None
    if not h.alive():
        ex._fail("crash", f"the target died on a GRAPH_COMPUTE whose src chain is {depth:,} deep", msg)
    h.survived_deep.add(depth)


def null_node(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GRAPH_COMPUTE naming node id 0 (a null node), with or without tensors."""
    buf = fresh_buffer(ex, d, 256)
    tensors = []
    if buf is not None and rng.random() < 0.5:
        a = _tensor(ex, buf, 0, (4,), int(GgmlType.F32), ex.scope.new_id())
        tensors = [a.fields]
    nodes = [0] if not tensors or rng.random() < 0.5 else [int(tensors[0]["id"]), 0]
    ex.send(ex.active(), FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": nodes, "tensors": tensors},
                                     broken="id: nodes.* = 0", tags=("id",)))


def get_rows_index(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GET_ROWS (or SET_ROWS) whose row indices, written by SET_TENSOR, point past the table."""
    buf = fresh_buffer(ex, d, 4096)
    if buf is None:
        return
    k = rng.choice((1, 2, 4))
    table = _tensor(ex, buf, 0, (4, 8), int(GgmlType.F32), ex.scope.new_id())
    rows = _tensor(ex, buf, 256, (k,), int(GgmlType.I32), ex.scope.new_id())
    out = _tensor(ex, buf, 512, (4, k), int(GgmlType.F32), ex.scope.new_id())
    conn = ex.active()
    bad = [rng.choice(BAD_ROWS) for _ in range(k)]
    fields = {"tensor": rows.fields, "offset": 0}
    if ex.protocol.cache_rule.flag_field:
        fields[ex.protocol.cache_rule.flag_field] = 0
    ex.send(conn, FuzzMessage(Command.SET_TENSOR, fields, struct.pack(f"<{k}i", *bad)))
    op = GgmlOp.GET_ROWS if rng.random() < 0.7 else GgmlOp.SET_ROWS
    node = dict(out.fields, op=int(op), flags=int(TensorFlag.COMPUTE),
                src=[table.fields["id"], rows.fields["id"]] + [0] * 8)
    if op is GgmlOp.SET_ROWS:  # dst = table with rows of src0 set: dst views the table
        node = dict(table.fields, id=ex.scope.new_id(), op=int(op), flags=int(TensorFlag.COMPUTE),
                    src=[out.fields["id"], rows.fields["id"]] + [0] * 8)
    ex.send(conn, FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [node["id"]],
                                                      "tensors": [table.fields, rows.fields, out.fields, node]},
                              broken=f"index: {op.name}.rows = {bad}", tags=("index",)))
    if not ex.inert and ex.current is conn and not ex.models[conn].closed:
        ex.send(conn, FuzzMessage(Command.GET_TENSOR, {"tensor": out.fields, "offset": 0, "size": out.nbytes},
                                  tags=("read-back",)))


def huge_claim(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """SET_TENSOR or GRAPH_COMPUTE whose size header is 2^63 or more."""
    claim = rng.choice((1 << 63, (1 << 63) + 1, (1 << 64) - 1))
    conn = ex.active()
    if rng.random() < 0.5:
        buf = fresh_buffer(ex, d, 64)
        if buf is None:
            return
        t = _tensor(ex, buf, 0, (16,), int(GgmlType.I8), ex.scope.new_id())
        fields = {"tensor": t.fields, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(Command.SET_TENSOR, fields, b"", size=claim)
    else:
        msg = FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": [1], "tensors": []}, size=claim)
    msg.broken, msg.tags = f"size: header claims {claim} bytes", ("size",)
    ex.send(conn, msg)


def region_edge(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A tensor command whose tensor or region sits just outside its buffer or just past the tensor's bytes."""
    size = rng.choice((64, 256, 4096))
    buf = fresh_buffer(ex, d, size)
    if buf is None:
        return
    n = rng.choice((1, 8, 16))
    where = rng.choice(("data past end", "data before base", "offset past nbytes", "size past nbytes"))
    offset = 0 if where != "data past end" else size
    if where == "data before base":
        offset = -rng.choice((1, 64))
    t = _tensor(ex, buf, max(0, offset), (n,), int(GgmlType.I8), ex.scope.new_id())
    fields_t = dict(t.fields, data=(buf.base + offset) % (1 << 64))
    commands = [Command.GET_TENSOR, Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR,
                Command.INIT_TENSOR, Command.GET_ALLOC_SIZE, Command.GRAPH_COMPUTE]
    cmd = rng.choice(commands)
    over = 1 if where in ("offset past nbytes", "size past nbytes") else 0
    off = rng.choice((1, n)) if where == "offset past nbytes" else 0
    length = n + over - off if where != "offset past nbytes" else n
    if cmd is Command.GET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t, "offset": off, "size": length})
    elif cmd is Command.SET_TENSOR:
        fields = {"tensor": fields_t, "offset": off}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(cmd, fields, bytes(rng.randrange(256) for _ in range(length)))
    elif cmd is Command.MEMSET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t, "offset": off, "size": length, "value": 0x41})
    elif cmd is Command.COPY_TENSOR:
        src = _tensor(ex, buf, 0, (n,), int(GgmlType.I8), ex.scope.new_id())
        pair = (src.fields, fields_t) if rng.random() < 0.5 else (fields_t, src.fields)
        msg = FuzzMessage(cmd, {"src": pair[0], "dst": pair[1]})
    elif cmd is Command.INIT_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": fields_t})
    elif cmd is Command.GET_ALLOC_SIZE:
        from ggml_rpc.spec import null_tensor

        msg = FuzzMessage(cmd, {"device": 0, "tensor": fields_t, "srcs": [null_tensor() for _ in range(10)]})
    else:
        node = dict(fields_t, op=int(GgmlOp.SCALE), flags=int(TensorFlag.COMPUTE))
        msg = FuzzMessage(cmd, {"device": 0, "nodes": [node["id"]], "tensors": [node]})
    # Named as the generic generator names the field it breaks, so that both meet in one finding class.
    if where in ("data past end", "data before base"):
        path = {Command.COPY_TENSOR: "src.data" if msg.fields.get("src") is fields_t else "dst.data",
                Command.GRAPH_COMPUTE: "tensors.0.data"}.get(cmd, "tensor.data")
        msg.broken = f"bound: {path} = {fields_t['data']:#x} ({where})"
    elif cmd is Command.SET_TENSOR and where == "size past nbytes":
        msg.broken = f"bound: data length = {length} (past the tensor's {n} bytes)"
    elif where == "offset past nbytes" and "offset" in msg.fields:
        msg.broken = f"bound: offset = {off} ({where})"
    elif "size" in msg.fields:
        msg.broken = f"bound: size = {length} ({where})"
    else:
        msg.broken = f"bound: tensor.ne = {n} ({where})"
    msg.tags = ("bound",)
    ex.send(ex.active(), msg)


def other_layout(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A SET_TENSOR in the other major's layout, sent as the bytes a mis-negotiated client would send."""
    buf = fresh_buffer(ex, d, 256)
    if buf is None:
        return
    n = rng.choice((8, 16, 64))
    t = _tensor(ex, buf, 0, (n,), int(GgmlType.I8), ex.scope.new_id())
    data = bytes([rng.randrange(1, 256)]) + bytes(rng.randrange(256) for _ in range(n - 1))
    if ex.protocol.cache_rule.flag_field:
        # v6 layout to a v7 server: offset 0 then data; read as cache_flag 0 and an offset whose top byte is the
        # first data byte.
        flag = ex.protocol.cache_rule.flag_field
        fields = {"tensor": t.fields, flag: 0, "offset": data[0] << 56}
        msg = FuzzMessage(Command.SET_TENSOR, fields, data[1:], broken="layout: v6 SET_TENSOR to v7")
    else:
        # v7 layout to a v6 server: cache_flag 0 and offset 0 read as offset 0, the offset's top byte as data.
        msg = FuzzMessage(Command.SET_TENSOR, {"tensor": t.fields, "offset": 0}, b"\0" + data,
                          broken="layout: v7 SET_TENSOR to v6")
    msg.tags = ("layout",)
    ex.send(ex.active(), msg)


def early_close(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A reply-bearing request, then the client closes without reading its reply; the server must live on."""
    ex.close_current()
    conn = ex.new_ref()
    ex.prepare(conn)
    if ex.inert or ex.tconn is None:
        return
    cmd = rng.choice((Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.GET_DEVICE_MEMORY,
                      Command.DEVICE_COUNT))
    fields = {} if cmd is Command.DEVICE_COUNT else {"device": 0}
    msg = FuzzMessage(cmd, fields, broken="early-close: before the reply", tags=("early-close",))
    ex.leave_early(conn, msg)


def fresh_read(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GET_TENSOR of a buffer nobody wrote, allocated right after one filled and freed (an info leak if the server
    hands out that allocation's bytes or its allocator's pointers)."""
    size = rng.choice((256, 1024, 4096, 16384, 65536))
    conn = ex.active()
    if rng.random() < 0.7:
        old = fresh_buffer(ex, d, size)
        if old is None:
            return
        t = _tensor(ex, old, 0, (size,), int(GgmlType.I8), ex.scope.new_id())
        fields = {"tensor": t.fields, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        ex.send(conn, FuzzMessage(Command.SET_TENSOR, fields, bytes([0x5A]) * size))
        ex.send(conn, FuzzMessage(Command.FREE_BUFFER, {"remote_ptr": old.handle}))
    new = fresh_buffer(ex, d, size)
    if new is None:
        return
    t = _tensor(ex, new, 0, (size,), int(GgmlType.I8), ex.scope.new_id())
    ex.send(conn, FuzzMessage(Command.GET_TENSOR, {"tensor": t.fields, "offset": 0, "size": size},
                              tags=("fresh-read",)))


#: (weight, strategy): how often each is picked among strategy steps.
STRATEGIES: tuple[tuple[int, Strategy], ...] = (
    (14, region_edge), (10, null_node), (10, get_rows_index), (10, huge_claim), (8, other_layout),
    (8, early_close), (12, fresh_read),
    (8, block_misaligned), (8, size_arithmetic), (8, foreign_buffer), (6, graph_structure), (10, kernel_bounds),
    (4, custom_op),
)


def strategy(rng: random.Random) -> Strategy:
    if rng.randrange(1000) < DEEP_PER_MILLE:
        return deep_chain
    total = sum(w for w, _ in STRATEGIES)
    pick = rng.randrange(total)
    for weight, fn in STRATEGIES:
        if pick < weight:
            return fn
        pick -= weight
    return STRATEGIES[-1][1]



__all__ = ["STRATEGIES", "Strategy", "strategy"]
