"""Framing: upstream's memory-safety bug classes (SECURITY.md's table, classes A-G) that a release build survives
silently.

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

from collections.abc import Callable

from ggml_rpc.conformance.checks._support import (
    PROBE,
    PROBE_REPLY_SIZE,
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
from ggml_rpc.conformance.checks.canaries import (
    COMPUTE,
    F32,
    I8,
    Guarded,
    acc_set_graph,
    each_graph,
    f32_bytes,
    gated_delta_net_graph,
    get_rows_graph,
    set_rows_graph,
    ssm_scan_graph,
)
from ggml_rpc.conformance.checks.framing import FR, get_tensor_request, graph_bytes, set_tensor_request
from ggml_rpc.conformance.harness import Context, hexdump
from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, GgmlType, encode_request, make_tensor, tensor_nbytes
from ggml_rpc.spec import Command as C
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.tensor import src_ids

Q4_0 = int(GgmlType.Q4_0)
#: A Q4_0 row of 33 elements: one element past its 32-element block (#25288).
MISALIGNED_NE0 = 33
#: Q4_0 block: 32 elements in 18 bytes.
Q4_0_BLOCK_BYTES = 18


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
        node = dict(out, id=0x2003, op=int(GgmlOp.CPY), flags=COMPUTE, src=src_ids(a["id"], out["id"]),
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
        # The probe right behind it: a correct server's empty reply is followed at once by the probe's, so neither
        # a byte too many after the empty reply nor a correct server costs a wait for the timeout.
        buf.client.send_raw(sent + PROBE)
        want, probe = REPLY_HEADER.pack(0), REPLY_HEADER.pack(PROBE_REPLY_SIZE)
        got = recv_upto(buf.client.sock, len(want) + len(probe) + PROBE_REPLY_SIZE, ctx.timeout)
        what = f"GET_TENSOR of 0 bytes of a tensor with ne[{dim}] = 0 at the buffer's last byte"
        after = got[len(want):len(want) + len(probe)]
        if got and (got[:len(want)] != want[:len(got)] or not probe.startswith(after)):
            raise fail(f"{what}: the reply is not empty", sent=hexdump(sent, 48), expected=f"{hexdump(want)} or a "
                       f"close, then the DEVICE_COUNT probe's reply {hexdump(probe)} + {PROBE_REPLY_SIZE} bytes",
                       got=hexdump(got))
        ctx.note(what, sent=hexdump(sent, 48), expected="an empty reply or a close",
                 got="an empty reply" if got else "closed")
        notes.append(f"{what}: {'empty reply' if got else 'refused'}")
        buf.client.close()
        g = Guarded.open(ctx)
        a = g.place(F32, tuple(ne), nb=EMPTY_NB, id=0x2102)
        out = g.place(F32, tuple(ne), nb=EMPTY_NB, id=0x2103, output=True, op=int(GgmlOp.SCALE), flags=COMPUTE,
                      src=src_ids(a["id"]), op_params=[0x40000000])
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
        node = dict(huge(buf, 0x2203), op=int(GgmlOp.SCALE), flags=COMPUTE, src=src_ids(a["id"]),
                    op_params=[0x3F800000] + [0] * 15)
        return graph_bytes(ctx.protocol, 0, [node["id"]], [a, node])

    bad_on_fresh(ctx, graph, "GRAPH_COMPUTE of a SCALE node whose size is 2^64 + 16 (16 modulo 2^64)")


# ---- B: views past their source ----------------------------------------------------------------------------------


@_check("FRAME-051", "a view whose view_offs lies past its source is refused or computed inside its own bytes "
        "(canaries around it intact)", FR, section=C.GRAPH_COMPUTE)
def view_past_source(ctx: Context) -> str:
    g = Guarded.open(ctx)
    a = g.place(F32, (4,), id=0x2301, values=f32_bytes([1, 2, 3, 4]))
    base = g.place(F32, (4,), id=0x2302, values=f32_bytes([0, 0, 0, 0]))
    # data says "base's bytes", view_src + view_offs says 1 MiB past them: a server deriving the address from the
    # view writes far outside the buffer.
    view = make_tensor(id=0x2303, type=F32, ne=(4,), buffer=g.buf.handle, data=base["data"], op=int(GgmlOp.SCALE),
                       flags=COMPUTE, src=src_ids(a["id"]), op_params=[0x40000000], view_src=base["id"],
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
        a = g.place(F32, (4,), id=0x2401, values=f32_bytes([1, 2, 3, 4]))
        out = g.place(F32, (4,), id=0x2402, output=True, op=int(GgmlOp.ADD), flags=COMPUTE,
                      src=src_ids(a["id"], a["id"]))
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
            out.update(op=int(GgmlOp.ADD), flags=COMPUTE, src=src_ids(a["id"], b["id"]))
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
        a = g.place(F32, (4,), id=0x2601, values=f32_bytes([1, 2, 3, 4]))
        x = g.place(F32, (4,), id=0x2602, output=True, op=int(GgmlOp.ADD), flags=COMPUTE)
        y = g.place(F32, (4,), id=0x2603, output=True, op=int(GgmlOp.ADD), flags=COMPUTE)
        nodes = [x["id"]]
        if shape == "self":
            x["src"] = src_ids(x["id"], a["id"])
        elif shape == "two":
            x["src"], y["src"] = src_ids(y["id"], a["id"]), src_ids(x["id"], a["id"])
            nodes = [x["id"], y["id"]]
        elif shape == "view":
            x.update(src=src_ids(a["id"], a["id"]), view_src=x["id"])
        else:
            x["src"] = src_ids(a["id"], a["id"])
            nodes = [x["id"], x["id"]]
        notes.append(g.run(ctx, nodes, [a, x, y], f"GRAPH_COMPUTE with a {shape} cycle" if shape != "twice"
                           else "GRAPH_COMPUTE listing one node twice"))
    return "; ".join(notes)


# ---- E: kernel bounds --------------------------------------------------------------------------------------------

#: An address no process maps: a server that calls the function pointer of a CUSTOM op dies on it (#25289).
FAULTING_POINTER = 0x4141_4141_4141_4141


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
    return "; ".join(each_graph(ctx, lambda g, r=r: get_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-056", "SET_ROWS with row indices outside its destination is refused or writes nothing outside it "
        "(canaries intact)", FR, section=C.GRAPH_COMPUTE)
def set_rows_out_of_range(ctx: Context) -> str:
    # #26912: the row index is a write position.
    return "; ".join(each_graph(ctx, lambda g, r=r: set_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-057", "ACC and SET whose op_params strides are negative or zero are refused or write nothing outside "
        "their result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def acc_set_strides(ctx: Context) -> str:
    # #25764: a negative nb1 keeps the window's first element inside the result but walks its later rows back out
    # of it; a zero stride with an offset near the end puts every row past it.
    return "; ".join(each_graph(ctx, lambda g, op=op, w=w: acc_set_graph(g, op, w))
                     for op in ACC_SET_OPS for w in BAD_WINDOWS)


@_check("FRAME-058", "SSM_SCAN whose ids tensor names states outside its state source is refused or reads nothing "
        "outside it (no canary byte in the output)", FR, section=C.GRAPH_COMPUTE)
def ssm_scan_ids(ctx: Context) -> str:
    # #25765: ids picks each sequence's initial state out of s.
    return "; ".join(each_graph(ctx, lambda g, i=i: ssm_scan_graph(g, i)) for i in BAD_STATE_IDS)


@_check("FRAME-059", "GATED_DELTA_NET whose op_params ask for more state snapshots than its result holds is refused "
        "or writes nothing outside its result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def gated_delta_net_params(ctx: Context) -> str:
    # #25704: op_params size the writes of the states.
    return "; ".join(each_graph(ctx, lambda g, k=k: gated_delta_net_graph(g, k)) for k in BAD_SNAPSHOTS)


# ---- F: ops whose op_params carry a function pointer -------------------------------------------------------------


@_check("FRAME-060", "GRAPH_COMPUTE of a CUSTOM or MAP_CUSTOM1/2/3 node (op_params carry a function pointer) closes "
        "the connection: the pointer is never called", FR, section=C.GRAPH_COMPUTE)
def custom_op_pointer(ctx: Context) -> None:
    # #25289: the client chooses the address the server calls.  It points where nothing is mapped, so a server
    # that calls it dies (a MUST failure) instead of running code.
    lo, hi = FAULTING_POINTER & 0xFFFF_FFFF, FAULTING_POINTER >> 32
    # ggml's custom op params: the function pointer, n_tasks (1), padding, the userdata pointer.
    params = [p - (1 << 32) if p >= 1 << 31 else p for p in (lo, hi, 1, 0, lo, hi)] + [0] * 10
    for op in (GgmlOp(o) for o in sorted(NATIVE_CALLBACK_OPS)):
        def build(buf: Buf, op: GgmlOp = op) -> bytes:
            srcs = [buf.f32(16 * i, (4,), id=0x2C01 + i) for i in range(3)]
            n_src = {GgmlOp.MAP_CUSTOM1: 1, GgmlOp.MAP_CUSTOM2: 2}.get(op, 3)
            out = buf.f32(64, (4,), id=0x2C10)
            out.update(op=int(op), flags=COMPUTE, op_params=params, src=src_ids(*(s["id"] for s in srcs[:n_src])))
            return graph_bytes(ctx.protocol, 0, [out["id"]], [*srcs, out])

        bad_on_fresh(ctx, build, f"GRAPH_COMPUTE of a {op.name} node whose function pointer is "
                     f"{FAULTING_POINTER:#x}")
