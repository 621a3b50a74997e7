"""What the blocking client (:mod:`.client`) is built from: its error, the per-command plans worked out once per
client (fixed request layouts, reply sizes), and the socket option for a client that leaves before its reply."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

from ggml_rpc.spec import Command, Payload, Protocol, UnknownCommand
from ggml_rpc.spec.codec import Buffer
from ggml_rpc.spec.layout import FlatLayout, flat_layout
from ggml_rpc.spec.messages import Shape

#: Largest reply the generic raw reader accepts unless told otherwise (a claim, checked before allocating).
MAX_RAW_REPLY = 1 << 32
# sendmsg takes at most IOV_MAX buffers; the codec never produces more than a handful.
MAX_PARTS = 1024


class ConnectionClosed(Exception):
    """The server closed the connection (or reset it) instead of sending the expected bytes."""


def as_bytes_view(part: Buffer) -> memoryview:
    mv = memoryview(part)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


@dataclass(frozen=True)
class Plan:
    """How one command of one version is sent and answered, worked out once per client."""

    request_layout: FlatLayout | None  # set for fixed-size requests
    reply: Payload | None  # None: no reply
    reply_layout: FlatLayout | None  # set for fixed-size replies
    reply_size: int

    @classmethod
    def of(cls, table: Protocol, command: Command) -> Plan:
        spec = table.spec(command)
        if spec is None:
            raise UnknownCommand(f"not a command of protocol {table.label}", command=command.name)
        req = spec.request
        request_layout = flat_layout(req.schema) if req.shape is Shape.FIXED else None
        if not spec.has_reply:
            return cls(request_layout, None, None, 0)
        reply = spec.reply
        assert isinstance(reply, Payload)
        if reply.shape is Shape.FIXED:
            return cls(request_layout, reply, flat_layout(reply.schema), reply.header_size)
        return cls(request_layout, reply, None, 0)


def cork(sock: socket.socket) -> None:
    """Hold back partial segments until the socket is closed (Linux ``TCP_CORK``; elsewhere nothing changes).

    A client that leaves before its reply then sends the last bytes of its request together with its FIN: the server
    cannot answer before it knows the client is gone, so its first reply write always meets a closed peer (reset),
    and a server that then writes again without MSG_NOSIGNAL dies of SIGPIPE every time, not only when the client
    happened to close quickly enough.
    """
    opt = getattr(socket, "TCP_CORK", None)
    if opt is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, opt, 1)



__all__ = ["MAX_PARTS", "MAX_RAW_REPLY", "ConnectionClosed", "Plan", "as_bytes_view", "cork"]
