"""Framing: upstream's memory-safety bug classes (issue 23, protocol.md §10) that a release build survives silently.

Each check sends one input of a class upstream fixed or still has -- tensors whose shape breaks its type's block
size (class C), size arithmetic with empty or overflowing dimensions and views past their source (B), tensors
without a buffer or of a foreign one inside graphs (A), cyclic graph structure (D), kernels driven out of bounds by
their index tensors or op_params (E), ops whose op_params carry a function pointer (F) -- and judges only what a
black box can see.  Nothing dies in a release build when a kernel reads or writes out of bounds, so the kernel
checks surround the tensors with *canaries* (random bytes, in the same buffer, right before and after them): a
server that refuses the graph (closes) passes; one that computes it must leave every canary as it was and return
no canary byte in an output.  A server that dies fails at the check's level (MUST for all of these).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ggml_rpc.conformance.checks._support import (
    Buf,
    alloc,
    bad_on_fresh,
    fail,
    nonce,
    recv_upto,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.cache import _probe as cache_entry_probe
from ggml_rpc.conformance.checks.deaths import expect_open_or_closed
from ggml_rpc.conformance.checks.framing import FR, get_tensor_request, graph_bytes, set_tensor_request
from ggml_rpc.conformance.harness import Context, hexdump
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import GgmlOp, GgmlType, TensorFlag, encode_request, make_tensor, tensor_nbytes
from ggml_rpc.spec.codec import REPLY_HEADER

F32, I32, I64, I8 = int(GgmlType.F32), int(GgmlType.I32), int(GgmlType.I64), int(GgmlType.I8)
Q4_0 = int(GgmlType.Q4_0)
#: A Q4_0 row of 33 elements: one element past its 32-element block (#25288).
MISALIGNED_NE0 = 33
#: Q4_0 block: 32 elements in 18 bytes.
Q4_0_BLOCK_BYTES = 18
#: Bytes of canary before and after each guarded tensor: more than one f32 row of every graph below.
CANARY = 64
#: An address no process maps: a server that calls the function pointer of a CUSTOM op dies on it (#25289).
FAULTING_POINTER = 0x4141_4141_4141_4141
COMPUTE = int(TensorFlag.COMPUTE)


def _srcs(*ids: int) -> list[int]:
    return [*ids, *([0] * (10 - len(ids)))]


# ---- C: a quantised tensor whose ne[0] is not a multiple of its block size --------------------------------------


def _misaligned(buf: Buf, offset: int, rows: int, *, id: int = 0x2001) -> dict:
    """A Q4_0 tensor of ``rows`` rows of 33 elements at ``base + offset`` (rows 36 bytes apart, so that its
    nbytes -- what every bounds check uses -- covers its rows: only the block size is wrong)."""
    return make_tensor(id=id, type=Q4_0, ne=(MISALIGNED_NE0, rows), nb=(Q4_0_BLOCK_BYTES, 36, 36 * rows, 36 * rows),
                       buffer=buf.handle, data=buf.base + offset)


@_check("FRAME-048", "a quantised tensor whose ne[0] is not a multiple of its block size (Q4_0, ne[0] = 33) closes "
        "the connection in SET/GET_TENSOR, SET_TENSOR_HASH, INIT_TENSOR, COPY_TENSOR and GRAPH_COMPUTE", FR,
        section="enum-types")
def misaligned_block(ctx: Context) -> str:
    p = ctx.protocol
    rows = 4

    def set_(buf: Buf) -> bytes:
        t = _misaligned(buf, 0, rows)
        return set_tensor_request(ctx, t, 0, nonce(16))

    def get(buf: Buf) -> bytes:
        return get_tensor_request(ctx, _misaligned(buf, 0, rows), 0, 16)

    def init(buf: Buf) -> bytes:
        return encode_request(p, C.INIT_TENSOR, {"tensor": _misaligned(buf, 0, rows)})

    def copy(buf: Buf) -> bytes:
        src = _misaligned(buf, 0, rows, id=0x2001)
        dst = buf.tensor(1024, tensor_nbytes(src), id=0x2002)
        return encode_request(p, C.COPY_TENSOR, {"src": src, "dst": dst})

    def graph(buf: Buf) -> bytes:
        # Dequantising CPY of the misaligned rows into f32: a kernel that trusts ne[0] reads past the last block.
        a = _misaligned(buf, 0, rows, id=0x2001)
        out = make_tensor(id=0x2002, type=F32, ne=(MISALIGNED_NE0, rows), buffer=buf.handle, data=buf.base + 1024)
        node = dict(out, id=0x2003, op=int(GgmlOp.CPY), flags=COMPUTE, src=_srcs(a["id"], out["id"]),
                    view_src=out["id"])
        return graph_bytes(p, 0, [node["id"]], [a, out, node])

    cases: list[tuple[str, Callable[[Buf], bytes]]] = [
        ("SET_TENSOR", set_), ("GET_TENSOR", get), ("INIT_TENSOR", init), ("COPY_TENSOR", copy),
        ("GRAPH_COMPUTE", graph),
    ]
    for name, build in cases:
        bad_on_fresh(ctx, build, f"{name} of a Q4_0 tensor with ne[0] = {MISALIGNED_NE0}")
    # SET_TENSOR_HASH validates its tensor only on a hit: it needs an entry of the server's cache (the one the cache
    # checks save, shared by the run).
    entry = ctx.shared("cache-entry", lambda: cache_entry_probe(ctx))
    if entry is None:
        return "SET_TENSOR_HASH case not run (no hash cache observed); the other five refused"
    n_rows = -(-len(entry.data) // 36) + 1
    buf = alloc(ctx.connect(), 36 * n_rows + 64)
    sent = encode_request(p, C.SET_TENSOR_HASH, {"tensor": _misaligned(buf, 0, n_rows), "offset": 0,
                                                 "hash": entry.digest})
    send_and_expect_close(ctx, buf.client, sent, f"SET_TENSOR_HASH hit into a Q4_0 tensor with ne[0] = "
                          f"{MISALIGNED_NE0}")
    return "all six commands refused"


# ---- B: size arithmetic -----------------------------------------------------------------------------------------


#: Strides of the empty tensors: a server still multiplying (ne[i] - 1) by them, with ne[i] = 0, computes a size
#: of about 2^64 - 2^32 (or, wrapped, anything).
EMPTY_NB = (4, 0xFFFF_FFF0, 0xFFFF_FFF0, 0xFFFF_FFF0)


@_check("FRAME-049", "a tensor with an empty dimension (ne[i] = 0) has no bytes: a 0-byte GET_TENSOR of it at the "
        "buffer's last byte reads nothing, a graph node with an empty dimension writes nothing", FR,
        section="rpc_tensor")
def empty_dimension(ctx: Context) -> str:
    # #9799: (ne[i] - 1) * nb[i] underflowed for ne[i] = 0 and the size became huge; the size is 0.
    notes = []
    for dim in (1, 3):
        ne = [4, 1, 1, 1]
        ne[dim] = 0
        buf = session(ctx)
        t = make_tensor(id=0x2101, type=F32, ne=tuple(ne), nb=EMPTY_NB, buffer=buf.handle,
                        data=buf.base + buf.size - 1)
        sent = get_tensor_request(ctx, t, 0, 0)
        buf.client.send_raw(sent)
        want = REPLY_HEADER.pack(0)
        got = recv_upto(buf.client.sock, len(want) + 1, ctx.timeout)
        what = f"GET_TENSOR of 0 bytes of a tensor with ne[{dim}] = 0 at the buffer's last byte"
        if got and got != want:
            raise fail(f"{what}: the reply is not empty", sent=hexdump(sent, 48), expected=f"{hexdump(want)} or a "
                       "close", got=hexdump(got))
        ctx.note(what, sent=hexdump(sent, 48), expected="an empty reply or a close",
                 got="an empty reply" if got else "closed")
        notes.append(f"{what}: {'empty reply' if got else 'refused'}")
        buf.client.close()
        g = Guarded.open(ctx)
        a = g.place(F32, tuple(ne), nb=EMPTY_NB, id=0x2102)
        out = g.place(F32, tuple(ne), nb=EMPTY_NB, id=0x2103, output=True, op=int(GgmlOp.SCALE), flags=COMPUTE,
                      src=_srcs(a["id"]), op_params=[0x40000000])
        notes.append(g.run(ctx, [out["id"]], [a, out], f"GRAPH_COMPUTE of SCALE of tensors with ne[{dim}] = 0"))
    return "; ".join(notes)


def overflowing_shape() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ne, nb) of an I8 tensor whose true size is 2^64 + 16 bytes but whose size computed modulo 2^64 is 16 bytes:
    a server summing ``(ne[i] - 1) * nb[i]`` in 64 bits sees a 16-byte tensor."""
    m = 0xFFFF_FFFF
    # 16 + 2 * (2^32 - 2) * 2^31 + 4 * 2^31 = 16 + 2^64 - 2^33 + 2^33
    return (16, m, m, 5), (1, 1 << 31, 1 << 31, 1 << 31)


@_check("FRAME-050", "a tensor whose ne x nb overflows 64 bits closes the connection (GET_TENSOR and as a "
        "GRAPH_COMPUTE node), never read or written as the wrapped size", FR, section="rpc_tensor")
def overflowing_size(ctx: Context) -> None:
    ne, nb = overflowing_shape()

    def huge(buf: Buf, id: int = 0x2201) -> dict:
        return make_tensor(id=id, type=I8, ne=ne, nb=nb, buffer=buf.handle, data=buf.base)

    bad_on_fresh(ctx, lambda buf: get_tensor_request(ctx, huge(buf), 0, 16),
                 "GET_TENSOR of 16 bytes of a tensor whose size is 2^64 + 16 (16 modulo 2^64)")

    def graph(buf: Buf) -> bytes:
        a = buf.f32(256, (4,), id=0x2202)
        node = dict(huge(buf, 0x2203), op=int(GgmlOp.SCALE), flags=COMPUTE, src=_srcs(a["id"]),
                    op_params=[0x3F800000] + [0] * 15)
        return graph_bytes(ctx.protocol, 0, [node["id"]], [a, node])

    bad_on_fresh(ctx, graph, "GRAPH_COMPUTE of a SCALE node whose size is 2^64 + 16 (16 modulo 2^64)")


# ---- canaries: what a kernel reads or writes around its tensors --------------------------------------------------


@dataclass
class Guarded:
    """One buffer whose every byte starts as fresh random bytes (the canaries); the graph's tensors are placed
    in it with :data:`CANARY` bytes of canary before and after each."""

    buf: Buf
    initial: bytes
    #: (start, end) of the bytes the graph may change: its nodes' outputs.
    writable: list[tuple[int, int]] = field(default_factory=list)
    #: (start, end) of the bytes the graph's tensors hold (the rest of the buffer is canary).
    placed: list[tuple[int, int]] = field(default_factory=list)
    _next: int = CANARY

    @classmethod
    def open(cls, ctx: Context, size: int = 8192) -> Guarded:
        buf = alloc(ctx.connect(), size)
        initial = nonce(buf.size)
        buf.client.set_tensor(buf.tensor(0, buf.size), 0, initial)
        return cls(buf, initial)

    def place(self, type_id: int, ne: Sequence[int], *, id: int, values: bytes | None = None,
              output: bool = False, **fields: object) -> dict:
        """A tensor with canaries on both sides; ``values`` are written into it, ``output`` marks it writable."""
        off = -(-self._next // 32) * 32
        t = make_tensor(id=id, type=type_id, ne=tuple(ne), buffer=self.buf.handle, data=self.buf.base + off,
                        **fields)  # type: ignore[arg-type]
        n = tensor_nbytes(t)
        if off + n + CANARY > self.buf.size:
            raise ValueError("the guarded tensors do not fit their buffer")
        self._next = off + n + CANARY
        self.placed.append((off, off + n))
        if output:
            self.writable.append((off, off + n))
        if values is not None:
            if len(values) != n:
                raise ValueError(f"{len(values)} bytes for a {n}-byte tensor")
            self.buf.client.set_tensor(t, 0, values)
            self.initial = self.initial[:off] + values + self.initial[off + n:]
        return t

    def run(self, ctx: Context, nodes: list[int], tensors: list[dict], what: str) -> str:
        """Send the graph and judge it: refused (closed) passes; computed, the canaries must be intact and no
        output may hold canary bytes."""
        sent = graph_bytes(ctx.protocol, 0, nodes, tensors)
        try:
            self.buf.client.send_raw(sent)
            how = expect_open_or_closed(ctx, self.buf.client, sent, what)
            if how == "refused":
                return f"{what}: refused"
            after = bytes(self.buf.client.get_tensor(self.buf.tensor(0, self.buf.size), 0, self.buf.size))
        finally:
            # A server serving one connection at a time (upstream) takes the next check's only after this one.
            self.buf.client.close()
        self._no_canary_written(after, what)
        self._no_canary_read(after, what)
        return f"{what}: computed, canaries intact"

    def _no_canary_written(self, after: bytes, what: str) -> None:
        allowed = bytearray(len(after))
        for lo, hi in self.writable:
            allowed[lo:hi] = b"\x01" * (hi - lo)
        for i, (a, b) in enumerate(zip(after, self.initial, strict=True)):
            if a != b and not allowed[i]:
                lo = max(0, i - 8)
                raise fail(f"{what}: byte {i} of the buffer, outside every output, was overwritten (an "
                           "out-of-bounds write)", expected=hexdump(self.initial[lo:lo + 32], 32),
                           got=hexdump(after[lo:lo + 32], 32))

    def _no_canary_read(self, after: bytes, what: str) -> None:
        # 8-byte windows of canary (random bytes, so a match by chance is out of the question) at every offset.
        canary = bytearray(self.initial)
        for lo, hi in self.placed:
            canary[lo:hi] = bytes(hi - lo)
        windows = {bytes(canary[i:i + 8]) for i in range(len(canary) - 7) if all(canary[i:i + 8])}
        for lo, hi in self.writable:
            out = after[lo:hi]
            for i in range(0, len(out) - 7):
                if out[i:i + 8] in windows:
                    raise fail(f"{what}: the output holds canary bytes from outside every source (an "
                               "out-of-bounds read)", expected="output computed from the sources only",
                               got=f"output byte {i}: {hexdump(out[i:i + 16], 16)}")


def _f32(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _i32(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


# ---- B: views past their source ----------------------------------------------------------------------------------


@_check("FRAME-051", "a view whose view_offs lies past its source is refused or computed inside its own bytes "
        "(canaries around it intact)", FR, section=C.GRAPH_COMPUTE)
def view_past_source(ctx: Context) -> str:
    g = Guarded.open(ctx)
    a = g.place(F32, (4,), id=0x2301, values=_f32([1, 2, 3, 4]))
    base = g.place(F32, (4,), id=0x2302, values=_f32([0, 0, 0, 0]))
    # data says "base's bytes", view_src + view_offs says 1 MiB past them: a server deriving the address from the
    # view writes far outside the buffer.
    view = make_tensor(id=0x2303, type=F32, ne=(4,), buffer=g.buf.handle, data=base["data"], op=int(GgmlOp.SCALE),
                       flags=COMPUTE, src=_srcs(a["id"]), op_params=[0x40000000], view_src=base["id"],
                       view_offs=1 << 20)
    g.writable.append((base["data"] - g.buf.base, base["data"] - g.buf.base + 16))
    return g.run(ctx, [view["id"]], [a, base, view], "GRAPH_COMPUTE of a SCALE node viewing 1 MiB past its source")


# ---- A: tensors without a buffer, or of a foreign one, inside graphs ---------------------------------------------


@_check("FRAME-052", "GRAPH_COMPUTE with a node or source that has no buffer (buffer 0, data 0) is refused or "
        "computed without touching memory (the server survives)", FR, section=C.GRAPH_COMPUTE)
def graph_null_buffer(ctx: Context) -> str:
    # CVE-2026-34159 / PR #20908 rejected buffer 0 with data != 0 (FRAME-029); with data 0 as well, a server that
    # runs the kernel reads or writes at address 0 + offsets.
    notes = []
    for role in ("node", "source"):
        g = Guarded.open(ctx)
        a = g.place(F32, (4,), id=0x2401, values=_f32([1, 2, 3, 4]))
        out = g.place(F32, (4,), id=0x2402, output=True, op=int(GgmlOp.ADD), flags=COMPUTE,
                      src=_srcs(a["id"], a["id"]))
        (out if role == "node" else a).update(buffer=0, data=0)
        notes.append(g.run(ctx, [out["id"]], [a, out], f"GRAPH_COMPUTE of ADD whose {role} has buffer 0, data 0"))
    return "; ".join(notes)


@_check("FRAME-053", "GRAPH_COMPUTE with a node or source in a freed buffer, or in another connection's, closes the "
        "connection", FR, section=C.GRAPH_COMPUTE)
def graph_foreign_buffer(ctx: Context) -> None:
    for role in ("node", "source"):
        for whose in ("freed on this connection", "of a closed connection"):
            if whose == "freed on this connection":
                buf = session(ctx)
                gone = alloc(buf.client, 4096)
                buf.client.free_buffer(gone.handle)
            else:
                # The other connection first (upstream serves one connection at a time), with two buffers: the
                # server may hand one's handle out again to this connection, never both.
                other = ctx.connect()
                olds = [alloc(other, 4096), alloc(other, 12288)]
                other.close()
                buf = session(ctx, 8192)
                gone = next(b for b in olds if b.handle != buf.handle)
            a = buf.f32(0, (4,), id=0x2501)
            b = buf.f32(16, (4,), id=0x2502)
            out = buf.f32(32, (4,), id=0x2503)
            out.update(op=int(GgmlOp.ADD), flags=COMPUTE, src=_srcs(a["id"], b["id"]))
            (out if role == "node" else b).update(buffer=gone.handle, data=gone.base)
            send_and_expect_close(ctx, buf.client, graph_bytes(ctx.protocol, 0, [out["id"]], [a, b, out]),
                                  f"GRAPH_COMPUTE whose {role} lies in a buffer {whose}")


# ---- D: graph structure ------------------------------------------------------------------------------------------


@_check("FRAME-054", "GRAPH_COMPUTE with cycles (a node its own source, a -> b -> a, a view of itself) or a node "
        "listed twice is refused or computed inside its tensors (the server survives)", FR, section=C.GRAPH_COMPUTE)
def graph_cycles(ctx: Context) -> str:
    notes = []
    for shape in ("self", "two", "view", "twice"):
        g = Guarded.open(ctx)
        a = g.place(F32, (4,), id=0x2601, values=_f32([1, 2, 3, 4]))
        x = g.place(F32, (4,), id=0x2602, output=True, op=int(GgmlOp.ADD), flags=COMPUTE)
        y = g.place(F32, (4,), id=0x2603, output=True, op=int(GgmlOp.ADD), flags=COMPUTE)
        nodes = [x["id"]]
        if shape == "self":
            x["src"] = _srcs(x["id"], a["id"])
        elif shape == "two":
            x["src"], y["src"] = _srcs(y["id"], a["id"]), _srcs(x["id"], a["id"])
            nodes = [x["id"], y["id"]]
        elif shape == "view":
            x.update(src=_srcs(a["id"], a["id"]), view_src=x["id"])
        else:
            x["src"] = _srcs(a["id"], a["id"])
            nodes = [x["id"], x["id"]]
        notes.append(g.run(ctx, nodes, [a, x, y], f"GRAPH_COMPUTE with a {shape} cycle" if shape != "twice"
                           else "GRAPH_COMPUTE listing one node twice"))
    return "; ".join(notes)


# ---- E: kernel bounds --------------------------------------------------------------------------------------------

#: A graph placed in a guarded buffer: its node ids, its tensors and what it is, for the evidence.
Graph = tuple[list[int], list[dict], str]


def get_rows_graph(g: Guarded, row: int, planes: int = 1) -> Graph:
    """GET_ROWS of rows [0, ``row``] of an 8-row f32 table into a 2-row result, for ``planes`` planes of indices.

    The table has one plane: with two, the second plane of indices reads the table's plane 1, 128 bytes on (its
    ne[2] = 1 hides that stride from its size, #26825's mismatched shapes), where the canary after the table lies.
    """
    table = g.place(F32, (4, 8), id=0x2701, nb=(4, 16, 128, 128), values=_f32([float(i) for i in range(32)]))
    idx = g.place(I32, (2, planes), id=0x2702, values=_i32([0, row] * planes))
    out = g.place(F32, (4, 2, planes), id=0x2703, output=True, op=int(GgmlOp.GET_ROWS), flags=COMPUTE,
                  src=_srcs(table["id"], idx["id"]))
    return [out["id"]], [table, idx, out], f"GET_ROWS of rows [0, {row}] of an 8-row table, {planes} plane(s)"


def set_rows_graph(g: Guarded, row: int, planes: int = 1) -> Graph:
    """SET_ROWS of two rows into rows [0, ``row``] of an 8-row f32 table (the node is a view of the table), from
    ``planes`` planes of rows.

    The table has one plane: with two, the second plane of rows is written 128 bytes on (the table's ne[2] = 1 hides
    that stride from its size, #26912), where the canary after the table lies."""
    rows = g.place(F32, (4, 2, planes), id=0x2801, values=_f32([100.0 + i for i in range(8 * planes)]))
    idx = g.place(I64, (2,), id=0x2802, values=struct.pack("<2q", 0, row))  # I64: every version's SET_ROWS
    table = g.place(F32, (4, 8), id=0x2803, nb=(4, 16, 128, 128), values=_f32([float(i) for i in range(32)]),
                    output=True)
    node = dict(table, id=0x2804, op=int(GgmlOp.SET_ROWS), flags=COMPUTE, src=_srcs(rows["id"], idx["id"]),
                view_src=table["id"])
    return ([node["id"]], [rows, idx, table, node],
            f"SET_ROWS of rows [0, {row}] into an 8-row table, {planes} plane(s) of rows")


def acc_set_graph(g: Guarded, op: GgmlOp, window: tuple[int, int, int, tuple[int, ...]]) -> Graph:
    """ACC or SET of a window of shape ``ne`` (f32) into a 4x4 f32 result: ``window`` = (nb1, nb2, offset, ne), the
    window's row and plane strides in bytes and its first byte in the result."""
    nb1, nb2, offset, ne = window
    a = g.place(F32, (4, 4), id=0x2901, values=_f32([1.0] * 16))
    n = 1
    for k in ne:
        n *= k
    b = g.place(F32, ne, id=0x2902, values=_f32([2.0] * n))
    # op_params: nb1, nb2, nb3 (dimension 3 of the window is 1: it moves nothing), offset, inplace
    out = g.place(F32, (4, 4), id=0x2903, output=True, op=int(op), flags=COMPUTE, src=_srcs(a["id"], b["id"]),
                  op_params=[nb1, nb2, 256, offset, 0])
    return [out["id"]], [a, b, out], f"{op.name} of a {'x'.join(map(str, ne))} window, nb1 = {nb1}, nb2 = {nb2}, " \
        f"offset = {offset}"


def ssm_scan_graph(g: Guarded, state_id: int) -> Graph:
    """SSM_SCAN of one token of one sequence from state ``state_id`` of 2 (N = 4, D = 2, H = 1, one group).

    x = 0 and A = 0: the state passes through unchanged (decay exp(0) = 1, nothing added), so a state read from
    outside s comes back in the result byte for byte."""
    s = g.place(F32, (4, 2, 1, 2), id=0x2A01, values=_f32([0.5] * 16))
    x = g.place(F32, (2, 1, 1, 1), id=0x2A02, values=_f32([0.0, 0.0]))
    dt = g.place(F32, (1, 1, 1, 1), id=0x2A03, values=_f32([0.1]))
    a = g.place(F32, (1, 1, 1, 1), id=0x2A04, values=_f32([0.0]))
    b = g.place(F32, (4, 1, 1, 1), id=0x2A05, values=_f32([1.0] * 4))
    c = g.place(F32, (4, 1, 1, 1), id=0x2A06, values=_f32([1.0] * 4))
    ids = g.place(I32, (1,), id=0x2A07, values=_i32([state_id]))
    # y (D x H x T x n = 2) then the final states (N x D x H x n = 8); op_params[0]: one state kept (8.0.0)
    out = g.place(F32, (10,), id=0x2A08, output=True, op=int(GgmlOp.SSM_SCAN), flags=COMPUTE,
                  src=_srcs(s["id"], x["id"], dt["id"], a["id"], b["id"], c["id"], ids["id"]), op_params=[1])
    return [out["id"]], [s, x, dt, a, b, c, ids, out], f"SSM_SCAN with ids [{state_id}] of 2 states"


def gated_delta_net_graph(g: Guarded, snapshots: int) -> Graph:
    """GATED_DELTA_NET (S = 2, one head, one token, one sequence) with op_params[0] = ``snapshots`` into a result
    sized for one state (y: S x Hv x T x n = 2, one state: S x S x Hv x n = 4)."""
    q = g.place(F32, (2, 1, 1, 1), id=0x2B01, values=_f32([0.5, 0.5]))
    k = g.place(F32, (2, 1, 1, 1), id=0x2B02, values=_f32([0.5, 0.5]))
    v = g.place(F32, (2, 1, 1, 1), id=0x2B03, values=_f32([1.0, 1.0]))
    gate = g.place(F32, (1, 1, 1, 1), id=0x2B04, values=_f32([-0.1]))
    beta = g.place(F32, (1, 1, 1, 1), id=0x2B05, values=_f32([0.5]))
    state = g.place(F32, (2, 2, 1, 1), id=0x2B06, values=_f32([0.0] * 4))
    out = g.place(F32, (6,), id=0x2B07, output=True, op=int(GgmlOp.GATED_DELTA_NET), flags=COMPUTE,
                  src=_srcs(q["id"], k["id"], v["id"], gate["id"], beta["id"], state["id"]), op_params=[snapshots])
    return ([out["id"]], [q, k, v, gate, beta, state, out],
            f"GATED_DELTA_NET with op_params[0] = {snapshots} into a result for 1 state")


def _each(ctx: Context, build: Callable[[Guarded], Graph]) -> str:
    g = Guarded.open(ctx, 16384)
    nodes, tensors, what = build(g)
    return g.run(ctx, nodes, tensors, what)


#: (row, planes) of the GET_ROWS / SET_ROWS checks: rows in range in a second plane the table does not have (the
#: canary after it); rows right after and before the table (its canaries) and far outside the buffer.
BAD_ROWS = ((1, 2), (8, 1), (-1, 1), (1 << 20, 1))
#: ACC/SET windows (nb1, nb2, offset, window shape): rows walking back into the canary before the result while
#: the planes walk forward by as much, so that the window's far corner lands inside (#25764: a check of the corner
#: alone passes); rows walking back with nothing to cancel them; all rows at one place, past the result's end.
BAD_WINDOWS = ((-64, 64, 0, (4, 2, 2)), (-16, 256, 0, (4, 4)), (0, 256, 60, (4, 4)))
#: The two ops of the window checks.
ACC_SET_OPS = (GgmlOp.ACC, GgmlOp.SET)
#: SSM_SCAN state ids: the canaries after and before s (2 states), and far outside the buffer.
BAD_STATE_IDS = (2, -1, 1 << 20)
#: GATED_DELTA_NET snapshot counts: 64 states where the result holds one, and a negative count.
BAD_SNAPSHOTS = (64, -1)


@_check("FRAME-055", "GET_ROWS with row indices outside its source is refused or reads nothing outside it "
        "(no canary byte in the output)", FR, section=C.GRAPH_COMPUTE)
def get_rows_out_of_range(ctx: Context) -> str:
    # #26825: the rows read past the table came back by GET_TENSOR.
    return "; ".join(_each(ctx, lambda g, r=r: get_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-056", "SET_ROWS with row indices outside its destination is refused or writes nothing outside it "
        "(canaries intact)", FR, section=C.GRAPH_COMPUTE)
def set_rows_out_of_range(ctx: Context) -> str:
    # #26912: the row index is a write position.
    return "; ".join(_each(ctx, lambda g, r=r: set_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-057", "ACC and SET whose op_params strides are negative or zero are refused or write nothing outside "
        "their result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def acc_set_strides(ctx: Context) -> str:
    # #25764: a negative nb1 keeps the window's first element inside the result but walks its later rows back out
    # of it; a zero stride with an offset near the end puts every row past it.
    return "; ".join(_each(ctx, lambda g, op=op, w=w: acc_set_graph(g, op, w))
                     for op in ACC_SET_OPS for w in BAD_WINDOWS)


@_check("FRAME-058", "SSM_SCAN whose ids tensor names states outside its state source is refused or reads nothing "
        "outside it (no canary byte in the output)", FR, section=C.GRAPH_COMPUTE)
def ssm_scan_ids(ctx: Context) -> str:
    # #25765: ids picks each sequence's initial state out of s.
    return "; ".join(_each(ctx, lambda g, i=i: ssm_scan_graph(g, i)) for i in BAD_STATE_IDS)


@_check("FRAME-059", "GATED_DELTA_NET whose op_params ask for more state snapshots than its result holds is refused "
        "or writes nothing outside its result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def gated_delta_net_params(ctx: Context) -> str:
    # #25704: op_params size the writes of the states.
    return "; ".join(_each(ctx, lambda g, k=k: gated_delta_net_graph(g, k)) for k in BAD_SNAPSHOTS)


# ---- F: ops whose op_params carry a function pointer -------------------------------------------------------------


@_check("FRAME-060", "GRAPH_COMPUTE of a CUSTOM or MAP_CUSTOM1/2/3 node (op_params carry a function pointer) closes "
        "the connection: the pointer is never called", FR, section=C.GRAPH_COMPUTE)
def custom_op_pointer(ctx: Context) -> None:
    # #25289: the client chooses the address the server calls.  It points where nothing is mapped, so a server
    # that calls it dies (a MUST failure) instead of running code.
    lo, hi = FAULTING_POINTER & 0xFFFF_FFFF, FAULTING_POINTER >> 32
    # ggml's custom op params: the function pointer, n_tasks (1), padding, the userdata pointer.
    params = [p - (1 << 32) if p >= 1 << 31 else p for p in (lo, hi, 1, 0, lo, hi)] + [0] * 10
    for op in (GgmlOp.CUSTOM, GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2, GgmlOp.MAP_CUSTOM3):
        def build(buf: Buf, op: GgmlOp = op) -> bytes:
            srcs = [buf.f32(16 * i, (4,), id=0x2C01 + i) for i in range(3)]
            n_src = {GgmlOp.MAP_CUSTOM1: 1, GgmlOp.MAP_CUSTOM2: 2}.get(op, 3)
            out = buf.f32(64, (4,), id=0x2C10)
            out.update(op=int(op), flags=COMPUTE, op_params=params, src=_srcs(*(s["id"] for s in srcs[:n_src])))
            return graph_bytes(ctx.protocol, 0, [out["id"]], [*srcs, out])

        bad_on_fresh(ctx, build, f"GRAPH_COMPUTE of a {op.name} node whose function pointer is "
                     f"{FAULTING_POINTER:#x}")
