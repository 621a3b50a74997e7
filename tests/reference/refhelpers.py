"""Shared helpers for the reference server tests: connect, allocate a tensor, send without waiting, check closes."""

from __future__ import annotations

from typing import Any

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.spec import Command, make_tensor, request_parts

TIMEOUT = 10.0


def connect(srv: Any, **kw: Any) -> RpcClient:
    return RpcClient.connect(srv.host, srv.port, timeout=TIMEOUT, **kw)


def assert_served(srv: Any) -> None:
    """A new connection gets a full HELLO and a reply: the server survived whatever came before."""
    with connect(srv) as c:
        assert c.server_version == srv.protocol.version
        assert c.device_count() >= 1


def tensor_in(c: RpcClient, size: int = 1024, *, type: int = 0, ne: tuple[int, ...] | None = None,
              device: int = 0, id: int = 1, **kw: Any) -> tuple[dict, int, int]:
    """A fresh buffer of ``size`` bytes and a tensor covering it: (tensor, handle, base)."""
    handle, got = c.alloc_buffer(device, size)
    assert handle != 0 and got == size
    base = c.buffer_get_base(handle)
    if ne is None:
        ne = (size // 4,)
    return make_tensor(id=id, type=type, ne=ne, buffer=handle, data=base, **kw), handle, base


def send_only(c: RpcClient, command: Command, fields: dict | None = None, data: bytes | None = None) -> None:
    """Send one request without reading anything back."""
    c.send_raw(request_parts(c.protocol, command, fields, data))


def assert_closes(c: RpcClient, command: Command, fields: dict | None = None, data: bytes | None = None) -> None:
    """The server closes the connection on this request, without a single reply byte."""
    send_only(c, command, fields, data)
    assert c.expect_closed(TIMEOUT), f"{command.name} was answered or the connection stayed open"
