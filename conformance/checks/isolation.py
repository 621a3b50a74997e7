"""Isolation between connections: a buffer belongs to the connection that allocated it and dies with it."""

from __future__ import annotations

import socket

from ggml_rpc.conformance.checks._support import I8, alloc, nonce, send_and_expect_close
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import Category, Context, Skipped
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import encode_request, make_tensor

ISO = Category.ISOLATION
#: How long a second connection's HELLO may wait before the server counts as serving one connection at a time.
SECOND_HELLO_WAIT = 2.0


def _leftover(ctx: Context) -> tuple[int, int]:
    """Handle and base of a buffer (holding data) whose connection has closed."""
    owner = ctx.connect()
    buf = alloc(owner, 4096)
    owner.set_tensor(buf.tensor(0, 64), 0, nonce(64))
    owner.close()
    return buf.handle, buf.base


@_check("ISO-001", "a buffer handle of a closed connection is refused (BUFFER_GET_BASE closes)", ISO,
        section=C.BUFFER_GET_BASE)
def closed_handle(ctx: Context) -> None:
    handle, _base = _leftover(ctx)
    client = ctx.connect()
    send_and_expect_close(ctx, client, encode_request(ctx.protocol, C.BUFFER_GET_BASE, {"remote_ptr": handle}),
                          "BUFFER_GET_BASE with the handle of a closed connection")


@_check("ISO-002", "a closed connection's buffer cannot be read through its handle and address (GET_TENSOR closes)",
        ISO, section=C.GET_TENSOR)
def closed_data(ctx: Context) -> None:
    handle, base = _leftover(ctx)
    client = ctx.connect()
    t = make_tensor(id=1, type=I8, ne=(64,), buffer=handle, data=base)
    send_and_expect_close(ctx, client, encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": 0,
                                                                                 "size": 64}),
                          "GET_TENSOR through the handle of a closed connection")


def _second_connection(ctx: Context) -> RpcClient:
    """A second live connection, or Skipped when the server serves one connection at a time."""
    try:
        return ctx.connect(timeout=SECOND_HELLO_WAIT)
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if isinstance(cause, (TimeoutError, socket.timeout, ConnectionClosed)) or "timed out" in str(exc):
            raise Skipped("the server serves one connection at a time (a second HELLO waits), as upstream does: "
                          "cross-connection handles cannot be tried while their owner is alive") from None
        raise


@_check("ISO-003", "a live connection's buffer handle is refused on another connection", ISO,
        section=C.BUFFER_GET_BASE)
def live_handle(ctx: Context) -> None:
    owner = ctx.connect()
    buf = alloc(owner, 4096)
    other = _second_connection(ctx)
    other.sock.settimeout(ctx.timeout)
    send_and_expect_close(ctx, other, encode_request(ctx.protocol, C.BUFFER_GET_BASE, {"remote_ptr": buf.handle}),
                          "BUFFER_GET_BASE with another live connection's handle")
