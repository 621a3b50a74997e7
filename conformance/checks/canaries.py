"""Canaries: what a kernel reads or writes around its tensors, seen from outside (the kernel checks of SECURITY.md's
classes).

A :class:`Guarded` buffer starts as fresh random bytes; the graph's tensors are placed in it with
:data:`CANARY` bytes of canary before and after each. A server that computes a graph must leave every canary as
it was and return no canary byte in an output; one that refuses it (closes) passes. The graph builders here make
the graphs of the kernel-bounds and graph-structure checks (:mod:`.bug_classes`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ggml_rpc.conformance.checks._support import (
    Buf,
    alloc,
    fail,
    nonce,
)
from ggml_rpc.conformance.checks.deaths import expect_open_or_closed
from ggml_rpc.conformance.checks.framing import graph_bytes
from ggml_rpc.conformance.harness import Context, hexdump
from ggml_rpc.spec import GgmlOp, GgmlType, TensorFlag, make_tensor, tensor_nbytes
from ggml_rpc.spec.tensor import src_ids

F32, I32, I64, I8 = int(GgmlType.F32), int(GgmlType.I32), int(GgmlType.I64), int(GgmlType.I8)
#: Bytes of canary before and after each guarded tensor: more than one f32 row of every graph below.
CANARY = 64
COMPUTE = int(TensorFlag.COMPUTE)


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


def f32_bytes(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def i32_bytes(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)



#: A graph placed in a guarded buffer: its node ids, its tensors and what it is, for the evidence.
Graph = tuple[list[int], list[dict], str]


def get_rows_graph(g: Guarded, row: int, planes: int = 1) -> Graph:
    """GET_ROWS of rows [0, ``row``] of an 8-row f32 table into a 2-row result, for ``planes`` planes of indices.

    The table has one plane: with two, the second plane of indices reads the table's plane 1, 128 bytes on (its
    ne[2] = 1 hides that stride from its size, #26825's mismatched shapes), where the canary after the table lies.
    """
    table = g.place(F32, (4, 8), id=0x2701, nb=(4, 16, 128, 128), values=f32_bytes([float(i) for i in range(32)]))
    idx = g.place(I32, (2, planes), id=0x2702, values=i32_bytes([0, row] * planes))
    out = g.place(F32, (4, 2, planes), id=0x2703, output=True, op=int(GgmlOp.GET_ROWS), flags=COMPUTE,
                  src=src_ids(table["id"], idx["id"]))
    return [out["id"]], [table, idx, out], f"GET_ROWS of rows [0, {row}] of an 8-row table, {planes} plane(s)"


def set_rows_graph(g: Guarded, row: int, planes: int = 1) -> Graph:
    """SET_ROWS of two rows into rows [0, ``row``] of an 8-row f32 table (the node is a view of the table), from
    ``planes`` planes of rows.

    The table has one plane: with two, the second plane of rows is written 128 bytes on (the table's ne[2] = 1 hides
    that stride from its size, #26912), where the canary after the table lies."""
    rows = g.place(F32, (4, 2, planes), id=0x2801, values=f32_bytes([100.0 + i for i in range(8 * planes)]))
    idx = g.place(I64, (2,), id=0x2802, values=struct.pack("<2q", 0, row))  # I64: every version's SET_ROWS
    table = g.place(F32, (4, 8), id=0x2803, nb=(4, 16, 128, 128), values=f32_bytes([float(i) for i in range(32)]),
                    output=True)
    node = dict(table, id=0x2804, op=int(GgmlOp.SET_ROWS), flags=COMPUTE, src=src_ids(rows["id"], idx["id"]),
                view_src=table["id"])
    return ([node["id"]], [rows, idx, table, node],
            f"SET_ROWS of rows [0, {row}] into an 8-row table, {planes} plane(s) of rows")


def acc_set_graph(g: Guarded, op: GgmlOp, window: tuple[int, int, int, tuple[int, ...]]) -> Graph:
    """ACC or SET of a window of shape ``ne`` (f32) into a 4x4 f32 result: ``window`` = (nb1, nb2, offset, ne), the
    window's row and plane strides in bytes and its first byte in the result."""
    nb1, nb2, offset, ne = window
    a = g.place(F32, (4, 4), id=0x2901, values=f32_bytes([1.0] * 16))
    n = 1
    for k in ne:
        n *= k
    b = g.place(F32, ne, id=0x2902, values=f32_bytes([2.0] * n))
    # op_params: nb1, nb2, nb3 (dimension 3 of the window is 1: it moves nothing), offset, inplace
    out = g.place(F32, (4, 4), id=0x2903, output=True, op=int(op), flags=COMPUTE, src=src_ids(a["id"], b["id"]),
                  op_params=[nb1, nb2, 256, offset, 0])
    return [out["id"]], [a, b, out], f"{op.name} of a {'x'.join(map(str, ne))} window, nb1 = {nb1}, nb2 = {nb2}, " \
        f"offset = {offset}"


def ssm_scan_graph(g: Guarded, state_id: int) -> Graph:
    """SSM_SCAN of one token of one sequence from state ``state_id`` of 2 (N = 4, D = 2, H = 1, one group).

    x = 0 and A = 0: the state passes through unchanged (decay exp(0) = 1, nothing added), so a state read from
    outside s comes back in the result byte for byte."""
    s = g.place(F32, (4, 2, 1, 2), id=0x2A01, values=f32_bytes([0.5] * 16))
    x = g.place(F32, (2, 1, 1, 1), id=0x2A02, values=f32_bytes([0.0, 0.0]))
    dt = g.place(F32, (1, 1, 1, 1), id=0x2A03, values=f32_bytes([0.1]))
    a = g.place(F32, (1, 1, 1, 1), id=0x2A04, values=f32_bytes([0.0]))
    b = g.place(F32, (4, 1, 1, 1), id=0x2A05, values=f32_bytes([1.0] * 4))
    c = g.place(F32, (4, 1, 1, 1), id=0x2A06, values=f32_bytes([1.0] * 4))
    ids = g.place(I32, (1,), id=0x2A07, values=i32_bytes([state_id]))
    # y (D x H x T x n = 2) then the final states (N x D x H x n = 8); op_params[0]: one state kept (8.0.0)
    out = g.place(F32, (10,), id=0x2A08, output=True, op=int(GgmlOp.SSM_SCAN), flags=COMPUTE,
                  src=src_ids(s["id"], x["id"], dt["id"], a["id"], b["id"], c["id"], ids["id"]), op_params=[1])
    return [out["id"]], [s, x, dt, a, b, c, ids, out], f"SSM_SCAN with ids [{state_id}] of 2 states"


def gated_delta_net_graph(g: Guarded, snapshots: int) -> Graph:
    """GATED_DELTA_NET (S = 2, one head, one token, one sequence) with op_params[0] = ``snapshots`` into a result
    sized for one state (y: S x Hv x T x n = 2, one state: S x S x Hv x n = 4)."""
    q = g.place(F32, (2, 1, 1, 1), id=0x2B01, values=f32_bytes([0.5, 0.5]))
    k = g.place(F32, (2, 1, 1, 1), id=0x2B02, values=f32_bytes([0.5, 0.5]))
    v = g.place(F32, (2, 1, 1, 1), id=0x2B03, values=f32_bytes([1.0, 1.0]))
    gate = g.place(F32, (1, 1, 1, 1), id=0x2B04, values=f32_bytes([-0.1]))
    beta = g.place(F32, (1, 1, 1, 1), id=0x2B05, values=f32_bytes([0.5]))
    state = g.place(F32, (2, 2, 1, 1), id=0x2B06, values=f32_bytes([0.0] * 4))
    out = g.place(F32, (6,), id=0x2B07, output=True, op=int(GgmlOp.GATED_DELTA_NET), flags=COMPUTE,
                  src=src_ids(q["id"], k["id"], v["id"], gate["id"], beta["id"], state["id"]), op_params=[snapshots])
    return ([out["id"]], [q, k, v, gate, beta, state, out],
            f"GATED_DELTA_NET with op_params[0] = {snapshots} into a result for 1 state")


def each_graph(ctx: Context, build: Callable[[Guarded], Graph]) -> str:
    g = Guarded.open(ctx, 16384)
    nodes, tensors, what = build(g)
    return g.run(ctx, nodes, tensors, what)
