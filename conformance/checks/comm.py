"""8.0.0's communicator (tensor split): COMM_INIT's answers, COMM_ALLREDUCE's refusals, and a real sum over the
servers' link with the kit's own reference server as the other rank."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
from ggml_rpc.conformance.checks._support import (
    F32,
    expect_open,
    fail,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import Category, Context, Skipped, free_port
from ggml_rpc.reference.comm import bf16_bits, bf16_to_f32
from ggml_rpc.reference.server import Server, make_config
from ggml_rpc.spec import V8, encode_request, make_tensor
from ggml_rpc.spec import Command as C
from ggml_rpc.spec.facts import COMM_BF16_FROM_ELEMENTS, comm_wire_type
from ggml_rpc.spec.messages import COMM_HOST_SIZE

V8_ONLY = (8,)
COMM = Category.COMM


def _init_fields(rank: int, world: int, port: int, host: str = "") -> dict:
    return {"device": 0, "rank": rank, "world": world, "port": port, "host": host.encode().ljust(COMM_HOST_SIZE, b"\0")}


@_check("COMM-001", "COMM_INIT for other than two ranks answers 0 and the connection goes on", COMM,
        majors=V8_ONLY, section=C.COMM_INIT)
def init_world_size(ctx: Context) -> None:
    client = ctx.connect()
    for rank, world in ((0, 3), (2, 2), (0, 1)):
        ok = client.comm_init(0, rank, world, 1)
        ctx.note(f"COMM_INIT rank {rank} of {world}", expected="ok = 0", got=f"ok = {int(ok)}")
        if ok:
            raise fail(f"COMM_INIT rank {rank} of {world} answered 1", expected="0 (only two ranks are served)",
                       got="1")
    expect_open(ctx, client, encode_request(ctx.protocol, C.COMM_INIT, _init_fields(0, 1, 1)),
                "after refused COMM_INITs")


@_check("COMM-002", "COMM_ALLREDUCE without a communicator closes the connection", COMM, majors=V8_ONLY,
        section=C.COMM_ALLREDUCE, bad_input=True)
def allreduce_alone(ctx: Context) -> None:
    buf = session(ctx, 4096)
    sent = encode_request(ctx.protocol, C.COMM_ALLREDUCE, {"device": 0, "tensor": buf.f32(0, (16,), id=1)})
    send_and_expect_close(ctx, buf.client, sent, "COMM_ALLREDUCE before any COMM_INIT")


@contextlib.contextmanager
def _peer_reference(timeout: float) -> Iterator[RpcClient]:
    """The kit's reference server (8.0.0, loopback) as the other rank, and a connection to it."""
    server = Server(replace(make_config(V8), comm_timeout=timeout), "127.0.0.1", 0)
    runner = threading.Thread(target=server.serve_forever, daemon=True, name="comm-peer")
    runner.start()
    try:
        with RpcClient.connect("127.0.0.1", server.port, timeout=timeout) as client:
            yield client
    finally:
        server.stop()
        runner.join(timeout)


@_check("COMM-003", "COMM_ALLREDUCE sums the tensor with the other rank's (the kit's reference server as rank 1; "
        "F32, and BF16 on the link from 32,768 elements)", COMM, majors=V8_ONLY, section=C.COMM_ALLREDUCE)
def allreduce_with_reference(ctx: Context) -> str:
    if ctx.target.host not in ("127.0.0.1", "localhost", "::1"):
        raise Skipped("the reference rank connects only to loopback: run the check on the server's machine")
    port = free_port(ctx.target.host)
    rng = ctx.rng()
    counts = (256, COMM_BF16_FROM_ELEMENTS)
    with _peer_reference(ctx.timeout) as peer:
        theirs = session(ctx, 4 * sum(counts))
        ours_buf = peer.alloc_buffer(0, 4 * sum(counts))
        ours_base = peer.buffer_get_base(ours_buf[0])
        joined: dict[str, bool] = {}

        def join_ours() -> None:
            joined["reference"] = peer.comm_init(0, 1, 2, port, ctx.target.host)

        th = threading.Thread(target=join_ours, daemon=True)
        th.start()
        joined["server"] = theirs.client.comm_init(0, 0, 2, port)
        th.join(ctx.timeout + 6)
        ctx.note("COMM_INIT", sent=f"server rank 0 on port {port}, reference rank 1", got=str(joined))
        if not joined.get("server") or not joined.get("reference"):
            raise fail("the two ranks did not join", expected="ok = 1 on both", got=str(joined))
        notes, at = [], 0
        for n in counts:
            a = rng.standard_normal(n).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
            t_server = make_tensor(id=1, type=F32, ne=(n,), buffer=theirs.handle, data=theirs.base + at)
            t_ref = make_tensor(id=1, type=F32, ne=(n,), buffer=ours_buf[0], data=ours_base + at)
            at += 4 * n
            theirs.client.set_tensor(t_server, 0, a.tobytes())
            peer.set_tensor(t_ref, 0, b.tobytes())
            theirs.client.comm_allreduce(0, t_server)
            peer.comm_allreduce(0, t_ref)
            try:
                got = np.frombuffer(bytes(theirs.client.get_tensor(t_server, 0, 4 * n)), np.float32)
                ref = np.frombuffer(bytes(peer.get_tensor(t_ref, 0, 4 * n)), np.float32)
            except ConnectionClosed as exc:
                raise fail(f"a connection closed during COMM_ALLREDUCE of {n} elements", expected="both sums",
                           got=str(exc)) from None
            on_link = comm_wire_type(F32, n) != F32  # BF16 on the link: the other rank's copy arrives rounded
            wire_b = bf16_to_f32(bf16_bits(b)) if on_link else b
            want = a + wire_b
            wire = "BF16" if on_link else "F32"
            ctx.note(f"COMM_ALLREDUCE of {n} F32 ({wire} on the link)", expected="own + other rank's",
                     got=f"max |error| {float(np.max(np.abs(got - want))):.3g}")
            if not np.array_equal(got, want):
                i = int(np.argmax(got != want))
                raise fail(f"the server's sum of {n} elements differs at element {i}",
                           expected=f"{want[i]!r} (= {a[i]!r} + {wire_b[i]!r})", got=repr(got[i]))
            if not on_link and not np.array_equal(ref, want):
                raise fail("the reference rank's sum differs: the server sent other bytes than its tensor",
                           expected=repr(want[:4]), got=repr(ref[:4]))
            notes.append(f"{n} x F32 via {wire}")
        theirs.client.comm_free(0)
        peer.comm_free(0)
    return ", ".join(notes)
