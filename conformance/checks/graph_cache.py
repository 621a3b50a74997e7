"""8.0.0's graph cache: GRAPH_COMPUTE keeps a graph under (device, uid), GRAPH_RECOMPUTE names the uid, and a
recompute never runs a graph whose memory may be gone."""

from __future__ import annotations

import struct

import numpy as np
from ggml_rpc.conformance.checks._support import (
    alloc,
    expect_bytes,
    fail,
    raw_request,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.framing import add_graph, graph_bytes, recompute_bytes
from ggml_rpc.conformance.client import ConnectionClosed
from ggml_rpc.conformance.harness import Category, Context
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import GgmlOp

V8_ONLY = (8,)


@_check("COMPUTE-016", "GRAPH_RECOMPUTE re-runs the graph of the uid it names, with two graphs kept side by side",
        Category.COMPUTE, majors=V8_ONLY, section=C.GRAPH_RECOMPUTE)
def recompute_by_uid(ctx: Context) -> str:
    buf = session(ctx, 4096)
    nodes, (a, b, c) = add_graph(buf)
    product = dict(c, id=c["id"] + 1, op=int(GgmlOp.MUL), data=buf.base + 48)
    x, y = np.arange(1, 5, dtype=np.float32), np.full(4, 3, np.float32)
    buf.client.set_tensor(a, 0, x.tobytes())
    buf.client.set_tensor(b, 0, y.tobytes())
    buf.client.send_raw(graph_bytes(ctx.protocol, 0, nodes, [a, b, c], uid=0x51))  # c = a + b
    buf.client.send_raw(graph_bytes(ctx.protocol, 0, [product["id"]], [a, b, product], uid=0x52))  # a * b
    x2 = np.arange(10, 14, dtype=np.float32)
    buf.client.set_tensor(a, 0, x2.tobytes())
    buf.client.set_tensor(c, 0, bytes(16))
    ctx.note("two graphs", sent="uid 0x51: c = a + b; uid 0x52: d = a * b; then new a, c zeroed, RECOMPUTE 0x51")
    try:
        buf.client.send_raw(recompute_bytes(ctx.protocol, 0, 0x51))
        got = bytes(buf.client.get_tensor(c, 0, 16))
    except ConnectionClosed:
        raise fail("the server closed the connection on GRAPH_RECOMPUTE of a kept uid",
                   expected="graph 0x51 re-run", got="connection closed") from None
    expect_bytes("c after GRAPH_RECOMPUTE of uid 0x51 (a + b)", got, (x2 + y).tobytes())
    return "uid 0x51 re-ran a + b while uid 0x52 (a * b) was the last computed"


@_check("FRAME-045", "GRAPH_RECOMPUTE of a uid never computed closes the connection", Category.FRAMING,
        majors=V8_ONLY, section=C.GRAPH_RECOMPUTE)
def recompute_unknown_uid(ctx: Context) -> None:
    buf = session(ctx, 4096)
    nodes, tensors = add_graph(buf)
    buf.client.send_raw(graph_bytes(ctx.protocol, 0, nodes, tensors, uid=0x61))
    send_and_expect_close(ctx, buf.client, recompute_bytes(ctx.protocol, 0, 0x62),
                          "GRAPH_RECOMPUTE of uid 0x62 (only 0x61 was computed)")


@_check("FRAME-046", "GRAPH_RECOMPUTE after FREE_BUFFER of a buffer its graph uses closes the connection "
        "(never a use-after-free)", Category.FRAMING, majors=V8_ONLY, section=C.GRAPH_RECOMPUTE)
def recompute_after_free(ctx: Context) -> None:
    client = ctx.connect()
    buf = alloc(client, 4096)
    nodes, tensors = add_graph(buf)
    client.send_raw(graph_bytes(ctx.protocol, 0, nodes, tensors, uid=0x71))
    client.free_buffer(buf.handle)
    send_and_expect_close(ctx, client, recompute_bytes(ctx.protocol, 0, 0x71),
                          "GRAPH_RECOMPUTE of uid 0x71 after its buffer was freed")


@_check("FRAME-047", "GRAPH_COMPUTE shorter than its device, uid and counts (20 bytes) closes the connection",
        Category.FRAMING, majors=V8_ONLY, section=C.GRAPH_COMPUTE, rules=("DECODE",))
def graph_short_v8_head(ctx: Context) -> None:
    # A 7.0-shaped graph (no uid): 12 bytes of device and two zero counts, which 8.0.0 cannot parse.
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.GRAPH_COMPUTE, struct.pack("<III", 0, 0, 0)),
                          "GRAPH_COMPUTE of 12 bytes")
