"""Strategies of the hunt (``ggml-rpc fuzz --hunt``) aimed at upstream's reported bug classes (the checklist in
:mod:`.checklist`, SECURITY.md) and at what its builds were seen to die of.

Each one is a step of a seeded example: deep src chains, node id 0, row indices past the table, size headers of 2^63 and
more, tensors one byte outside their buffer or region, the other major's SET_TENSOR layout, a client that leaves before
its reply, and reads of fresh buffers (info leaks); and upstream's memory-safety bug classes (SECURITY.md; checks
FRAME-048..060 judge the same inputs): partial quantisation blocks (C), empty and wrapping sizes and views past their
source (B), null and freed buffers in graphs (A), cyclic graphs (D), kernel bounds driven by op_params and index
tensors (E) and CUSTOM ops' function pointers (F).  Every message goes through the example (model and target, same
invariants) like the generic generators' messages.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Protocol

import numpy as np
from ggml_rpc.spec import (
    NATIVE_CALLBACK_OPS,
    TYPES,
    Command,
    GgmlOp,
    GgmlType,
    TensorFlag,
    make_tensor,
    null_tensor,
    tensor_nbytes,
)
from ggml_rpc.spec.codec import TENSOR_DTYPE
from ggml_rpc.spec.tensor import src_ids

from .draws import RandomDraw
from .example import Example
from .message import FuzzMessage
from .shadow_writes import empty_outside, shadow_write
from .valid_requests import BufferRef, TensorRef

#: The src-chain depth upstream's recursive graph rebuild does not survive (6.0.0 and 7.0.0: 100,000 computes).
DEEP_CHAIN = 300_000
#: Out of 1,000 strategy picks, how many are the (89 MB) deep chain.
DEEP_PER_MILLE = 4
#: Seconds the 89 MB of a deep chain may take to go out and be answered (or closed).
DEEP_WAIT = 30.0
#: Row indices for GET_ROWS past any table the fuzzer builds.
BAD_ROWS = (-1, 8, 9, 1 << 16, 0x7FFFFFFF, -(1 << 31))


class HuntState(Protocol):
    """What a strategy needs of the hunt that runs it (:class:`.hunt.Hunt`)."""

    #: Src-chain depths the target outlived (:func:`deep_chain` sends each at most until it is outlived once).
    survived_deep: set[int]

    def alive(self) -> bool:
        """Does the target still accept a connection and answer HELLO?"""
        ...


Strategy = Callable[[HuntState, Example, RandomDraw, random.Random], None]


def fresh_buffer(ex: Example, d: RandomDraw, size: int) -> BufferRef | None:
    """A new buffer of ``size`` bytes on the example's open connection (None when the model refuses it)."""
    return ex.alloc(ex.active(), size, 0)


def _tensor(ex: Example, buf: BufferRef, offset: int, ne: tuple[int, ...], type_id: int, tid: int) -> TensorRef:
    t = make_tensor(id=tid, type=type_id, ne=ne, buffer=buf.handle, data=buf.base + offset)
    ref = TensorRef(t, buf, tensor_nbytes(t))
    ex.scope.all_tensors.append(ref)
    return ref


def deep_chain(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def null_node(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """GRAPH_COMPUTE naming node id 0 (a null node), with or without tensors."""
    buf = fresh_buffer(ex, d, 256)
    tensors = []
    if buf is not None and rng.random() < 0.5:
        a = _tensor(ex, buf, 0, (4,), int(GgmlType.F32), ex.scope.new_id())
        tensors = [a.fields]
    nodes = [0] if not tensors or rng.random() < 0.5 else [int(tensors[0]["id"]), 0]
    ex.send(ex.active(), FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": nodes, "tensors": tensors},
                                     broken="id: nodes.* = 0", tags=("id",)))


def get_rows_index(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def huge_claim(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def region_edge(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def other_layout(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def early_close(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


def fresh_read(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
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


# ---- upstream's memory-safety bug classes (checks FRAME-048..060 judge the same inputs) ---------------------------

#: Quantised types whose block holds more than one element (the IQ grid types need codebooks the model may lack).
BLOCK_TYPES = tuple(int(t) for t in (GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q8_0, GgmlType.Q2_K,
                                     GgmlType.Q4_K, GgmlType.Q6_K))
#: Addresses a server calling a CUSTOM op's function pointer jumps to: unmapped, so it dies instead of running code.
FAULTING_POINTERS = (0x4141_4141_4141_4141, 0xDEAD_0000_0000_0000, 0x10)
#: The ops whose op_params carry a function pointer (#25289), from spec's table.
CALLBACK_OPS = tuple(GgmlOp(op) for op in sorted(NATIVE_CALLBACK_OPS))
COMPUTE = int(TensorFlag.COMPUTE)
F32, I32, I64, I8 = int(GgmlType.F32), int(GgmlType.I32), int(GgmlType.I64), int(GgmlType.I8)


def _i32(v: int) -> int:
    """A value as the signed 32-bit op_param it is stored as."""
    v &= 0xFFFF_FFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class _Layout:
    """Tensors laid out in one fresh buffer, 64 bytes apart (so that a kernel's stray bytes land in the gaps), the
    buffer first filled with one byte value (BUFFER_CLEAR) so that model and target start from the same bytes.
    The tensors are not added to the example's scope: the generic generators must not reuse them as valid."""

    def __init__(self, ex: Example, buf: BufferRef) -> None:
        self.ex, self.buf, self.at = ex, buf, 64

    @classmethod
    def open(cls, ex: Example, d: RandomDraw, rng: random.Random, size: int = 8192) -> _Layout | None:
        buf = fresh_buffer(ex, d, size)
        if buf is None:
            return None
        ex.send(ex.active(), FuzzMessage(Command.BUFFER_CLEAR, {"remote_ptr": buf.handle,
                                                                 "value": rng.choice((0x00, 0x3C, 0x41))}))
        return cls(ex, buf)

    def place(self, type_id: int, ne: tuple[int, ...], **fields: object) -> dict:
        off = -(-self.at // 32) * 32
        t = make_tensor(id=self.ex.scope.new_id(), type=type_id, ne=ne, buffer=self.buf.handle,
                        data=self.buf.base + off, **fields)  # type: ignore[arg-type]
        # A tensor whose size is bogus on purpose (past 2^64) must not push the next one out of the buffer.
        self.at = off + min(tensor_nbytes(t), self.buf.size) + 64
        return t

    def fill(self, t: dict, data: bytes) -> None:
        """SET_TENSOR of ``data`` into ``t`` (a valid message: the index tensors' values)."""
        fields = {"tensor": t, "offset": 0}
        if self.ex.protocol.cache_rule.flag_field:
            fields[self.ex.protocol.cache_rule.flag_field] = 0
        self.ex.send(self.ex.active(), FuzzMessage(Command.SET_TENSOR, fields, data))

    def graph(self, nodes: list[int], tensors: list[dict], broken: str, tag: str) -> None:
        self.ex.send(self.ex.active(), FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": nodes,
                                                                             "tensors": tensors},
                                                   broken=broken, tags=(tag,)))


def block_misaligned(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A quantised tensor whose ne[0] ends inside a block (#25288), in one of the commands that take a tensor."""
    lay = _Layout.open(ex, d, rng, 16384)
    if lay is None:
        return
    type_id = rng.choice(BLOCK_TYPES)
    info = TYPES[type_id]
    ne0 = info.blck * rng.randint(0, 2) + rng.choice((1, info.blck // 2, info.blck - 1))
    rows = rng.randint(1, 4)
    row = -(-ne0 // info.blck) * info.size  # room for the partial block too
    t = lay.place(type_id, (ne0, rows), nb=(info.size, row, row * rows, row * rows))
    n = tensor_nbytes(t)
    broken = f"block: tensor.ne.0 = {ne0} ({info.name}, block {info.blck})"
    cmd = rng.choice((Command.SET_TENSOR, Command.GET_TENSOR, Command.INIT_TENSOR, Command.COPY_TENSOR,
                      Command.GET_ALLOC_SIZE, Command.SET_TENSOR_HASH, Command.GRAPH_COMPUTE))
    k = rng.randint(0, max(0, min(n, 64)))
    if cmd is Command.SET_TENSOR:
        fields = {"tensor": t, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(cmd, fields, bytes(rng.randrange(256) for _ in range(k)))
    elif cmd is Command.GET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": t, "offset": 0, "size": k})
    elif cmd is Command.INIT_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": t})
    elif cmd is Command.COPY_TENSOR:
        dst = lay.place(I8, (n,))
        pair = (t, dst) if rng.random() < 0.7 else (dst, t)
        msg = FuzzMessage(cmd, {"src": pair[0], "dst": pair[1]})
        broken = broken.replace("tensor.", "src." if pair[0] is t else "dst.")
    elif cmd is Command.GET_ALLOC_SIZE:
        msg = FuzzMessage(cmd, {"device": 0, "tensor": t, "srcs": [null_tensor() for _ in range(10)]})
    elif cmd is Command.SET_TENSOR_HASH:
        # Validated only on a hit: a hash the example sent before may be in the cache.
        digest = rng.choice(ex.scope.hashes) if ex.scope.hashes else rng.getrandbits(64)
        msg = FuzzMessage(cmd, {"tensor": t, "offset": 0, "hash": digest})
    else:
        out = lay.place(F32, (ne0, rows))
        node = dict(out, id=ex.scope.new_id(), op=int(GgmlOp.CPY), flags=COMPUTE, src=src_ids(t["id"], out["id"]),
                    view_src=out["id"])
        msg = FuzzMessage(cmd, {"device": 0, "nodes": [node["id"]], "tensors": [t, out, node]})
        broken = broken.replace("tensor.", "tensors.0.")
    msg.broken, msg.tags = broken, ("block",)
    ex.send(ex.active(), msg)


def size_arithmetic(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Size arithmetic (#9799 and views): an empty dimension with huge strides, ne x nb wrapping 64 bits, or a view
    whose view_offs leads past its source, read by GET_TENSOR or computed as a graph node."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    kind = rng.choice(("empty", "wrap", "view"))
    src = lay.place(F32, (4,))
    if kind == "empty":
        dim = rng.randrange(1, 4)
        ne = [4, 1, 1, 1]
        ne[dim] = 0
        nb = (4, *(rng.choice((0xFFFF_FFF0, 1 << 31, 16)) for _ in range(3)))
        t = lay.place(F32, tuple(ne), nb=nb)
        broken, tag = f"arith: tensor.ne.{dim} = 0 (nb {nb[dim]:#x})", "arith"
    elif kind == "wrap":
        m = 0xFFFF_FFFF
        # (2^32 - 2) * 2^31 twice and 4 * 2^31: 2^64 exactly, plus the first row (see FRAME-050)
        ne, nb = (16, m, m, 5), (4 if rng.random() < 0.5 else 1, 1 << 31, 1 << 31, 1 << 31)
        t = lay.place(F32 if nb[0] == 4 else I8, ne, nb=nb)
        broken, tag = "arith: tensor.ne = ne x nb past 2^64", "arith"
    else:
        offs = rng.choice((16, 1 << 20, 1 << 40, (1 << 64) - 16))
        t = lay.place(F32, (4,), view_src=src["id"], view_offs=offs)
        broken, tag = f"view: tensor.view_offs = {offs:#x} (past its 16-byte source)", "view"
    if kind != "view" and rng.random() < 0.4:
        ex.send(ex.active(), FuzzMessage(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": rng.choice((0, 4))},
                                         broken=broken, tags=(tag,)))
        return
    node = dict(t, op=int(GgmlOp.SCALE), flags=COMPUTE, src=src_ids(src["id"]), op_params=[0x40000000] + [0] * 15)
    lay.graph([node["id"]], [src, node], broken.replace("tensor.", "tensors.1."), tag)


def foreign_buffer(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A graph node or source with buffer 0 (data 0 or not), or in a buffer freed before (CVE-2026-34159 /
    PR #20908: buffer 0 skipped every check of graph node creation)."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    a = lay.place(F32, (4,))
    b = lay.place(F32, (4,))
    out = lay.place(F32, (4,), op=int(GgmlOp.ADD), flags=COMPUTE, src=src_ids(a["id"], b["id"]))
    victim = rng.choice(("node", "source"))
    t = out if victim == "node" else b
    how = rng.choice(("null", "null+data", "freed"))
    if how == "freed":
        gone = fresh_buffer(ex, d, 4096)
        if gone is None:
            return
        ex.send(ex.active(), FuzzMessage(Command.FREE_BUFFER, {"remote_ptr": gone.handle}))
        t.update(buffer=gone.handle, data=gone.base + rng.choice((0, 64)))
        broken = f"buffer: tensors.{2 if victim == 'node' else 1}.buffer = freed {gone.handle:#x}"
    else:
        t.update(buffer=0, data=0 if how == "null" else t["data"])
        broken = f"buffer: tensors.{2 if victim == 'node' else 1}.buffer = 0 ({'data 0' if how == 'null' else 'data'})"
    lay.graph([out["id"]], [a, b, out], broken, "buffer")


def graph_structure(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Graph structure: a node its own source or view, a -> b -> a, a node listed again, src ids out of range."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    a = lay.place(F32, (4,))
    x = lay.place(F32, (4,), op=int(GgmlOp.ADD), flags=COMPUTE, src=src_ids(a["id"], a["id"]))
    y = lay.place(F32, (4,), op=int(GgmlOp.MUL), flags=COMPUTE, src=src_ids(x["id"], a["id"]))
    nodes = [x["id"], y["id"]]
    shape = rng.choice(("self", "pair", "view", "again", "far"))
    if shape == "self":
        x["src"] = src_ids(x["id"], a["id"])
    elif shape == "pair":
        x["src"] = src_ids(y["id"], a["id"])
    elif shape == "view":
        x["view_src"] = rng.choice((x["id"], y["id"]))
    elif shape == "again":
        nodes = nodes + rng.choice(([x["id"]], [y["id"], x["id"]], [x["id"]] * 8))
    else:
        # An id no tensor carries, at the far end of the id space.
        x["src"] = src_ids(a["id"], rng.choice((1 << 63, (1 << 64) - 1, 1 << 32)))
    lay.graph(nodes, [a, x, y], f"graph: tensors.1.src = {shape}", "graph")


def kernel_bounds(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Kernel bounds release builds do not check: ACC/SET strides (#25764), SSM_SCAN ids (#25765), GATED_DELTA_NET
    op_params (#25704), GET_ROWS and SET_ROWS rows past the table or in planes it does not have (#26825, #26912)."""
    lay = _Layout.open(ex, d, rng, 16384)
    if lay is None:
        return
    op = rng.choice(("acc", "ssm", "gdn", "rows"))
    if op == "acc":
        window = rng.choice(((4, 1), (4, 4), (4, 2, 2)))
        a, b = lay.place(F32, (4, 4)), lay.place(F32, window)
        nb1 = rng.choice((-16, -64, -4096, 0, 4, 1 << 20))
        # A plane stride cancelling the row stride puts the window's far corner back inside (#25764).
        nb2 = rng.choice((256, -nb1, 64))
        offset = rng.choice((0, 4, 48, 60, 64, -4))
        kind = rng.choice((GgmlOp.ACC, GgmlOp.SET))
        out = lay.place(F32, (4, 4), op=int(kind), flags=COMPUTE, src=src_ids(a["id"], b["id"]),
                        op_params=[_i32(nb1), _i32(nb2), 256, _i32(offset), rng.choice((0, 1))])
        lay.graph([out["id"]], [a, b, out], f"kernel: {kind.name}.op_params = nb1 {nb1}, nb2 {nb2}, offset {offset}",
                  "kernel")
    elif op == "ssm":
        s = lay.place(F32, (4, 2, 1, 2))
        x, dt, aa = lay.place(F32, (2, 1, 1, 1)), lay.place(F32, (1, 1, 1, 1)), lay.place(F32, (1, 1, 1, 1))
        b, c, ids = lay.place(F32, (4, 1, 1, 1)), lay.place(F32, (4, 1, 1, 1)), lay.place(I32, (1,))
        bad = rng.choice((2, 3, -1, 1 << 20, -(1 << 31)))
        lay.fill(ids, struct.pack("<i", bad))
        out = lay.place(F32, (10,), op=int(GgmlOp.SSM_SCAN), flags=COMPUTE,
                        src=src_ids(*(t["id"] for t in (s, x, dt, aa, b, c, ids))), op_params=[1])
        lay.graph([out["id"]], [s, x, dt, aa, b, c, ids, out], f"kernel: SSM_SCAN.ids = {bad}", "kernel")
    elif op == "gdn":
        parts = [lay.place(F32, ne) for ne in ((2, 1, 1, 1), (2, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1),
                                               (2, 2, 1, 1))]
        k = rng.choice((0, 2, 64, -1, 1 << 20))
        out = lay.place(F32, (6,), op=int(GgmlOp.GATED_DELTA_NET), flags=COMPUTE,
                        src=src_ids(*(t["id"] for t in parts)), op_params=[_i32(k)])
        lay.graph([out["id"]], [*parts, out], f"kernel: GATED_DELTA_NET.op_params.0 = {k}", "kernel")
    else:
        # Rows out of range, or in range in planes the table does not have: its ne[2] = 1 hides nb[2] from its size,
        # so plane 1 lies past it (#26825 reading, #26912 writing).
        planes = rng.choice((1, 2))
        bad = rng.choice((8, -1, 1 << 20)) if planes == 1 else rng.randrange(8)
        table = lay.place(F32, (4, 8), nb=(4, 16, rng.choice((128, 1 << 30)), 128))
        if rng.random() < 0.5:
            rows = lay.place(F32, (4, 2, planes))
            idx = lay.place(I64, (2,))
            lay.fill(idx, struct.pack("<2q", 0, bad))
            node = dict(table, id=ex.scope.new_id(), op=int(GgmlOp.SET_ROWS), flags=COMPUTE,
                        src=src_ids(rows["id"], idx["id"]), view_src=table["id"])
            lay.graph([node["id"]], [rows, idx, table, node], f"kernel: SET_ROWS.rows = {bad}, planes {planes}",
                      "kernel")
        else:
            idx = lay.place(I32, (2, planes))
            lay.fill(idx, struct.pack(f"<{2 * planes}i", *([0, bad] * planes)))
            out = lay.place(F32, (4, 2, planes), op=int(GgmlOp.GET_ROWS), flags=COMPUTE,
                            src=src_ids(table["id"], idx["id"]))
            lay.graph([out["id"]], [table, idx, out], f"kernel: GET_ROWS.rows = {bad}, planes {planes}", "kernel")


def custom_op(h: HuntState, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A CUSTOM / MAP_CUSTOM1-3 node whose op_params hold an unmapped function pointer (#25289): a server that
    calls it dies."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    op = rng.choice(CALLBACK_OPS)
    pointer = rng.choice(FAULTING_POINTERS)
    srcs = [lay.place(F32, (4,)) for _ in range(3)]
    n_src = {GgmlOp.MAP_CUSTOM1: 1, GgmlOp.MAP_CUSTOM2: 2}.get(op, rng.randint(0, 3))
    params = [_i32(pointer), _i32(pointer >> 32), 1, 0, _i32(pointer), _i32(pointer >> 32)]
    out = lay.place(F32, (4,), op=int(op), flags=COMPUTE, src=src_ids(*(t["id"] for t in srcs[:n_src])),
                    op_params=params + [0] * 10)
    lay.graph([out["id"]], [*srcs, out], f"custom: {op.name}.op_params = {pointer:#x}", "custom")


#: (weight, strategy): how often each is picked among strategy steps.
STRATEGIES: tuple[tuple[int, Strategy], ...] = (
    (14, region_edge), (10, null_node), (10, get_rows_index), (10, huge_claim), (8, other_layout),
    (8, early_close), (12, fresh_read),
    (8, block_misaligned), (8, size_arithmetic), (8, foreign_buffer), (6, graph_structure), (10, kernel_bounds),
    (4, custom_op), (24, shadow_write), (10, empty_outside),
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



__all__ = ["STRATEGIES", "HuntState", "Strategy", "strategy"]
