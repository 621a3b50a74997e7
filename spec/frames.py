"""How requests are framed, as facts of a version: per command, the valid sizes and where bulk data begins.

The streaming framers (:mod:`.framing`) and the reference server's receive path (which reads the bytes itself,
straight into their destination) both frame by this table, so there is one framing of the protocol.
"""

from __future__ import annotations

from typing import NamedTuple

from .enums import NEVER_ON_WIRE, Command, command_name
from .errors import HandshakeError, ProtocolError, SizeLimitExceeded, SizeMismatch, UnknownCommand
from .messages import Payload, Shape
from .payloads import DEFAULT_MAX_PAYLOAD
from .versions import V6, Protocol

#: HELLO's wire id, the same in every version (upstream asserts it at compile time).
HELLO_ID = 14


class RequestFrame(NamedTuple):
    """How one command's requests are framed after the handshake."""

    command: Command
    payload: Payload
    #: The only valid size (FIXED), or -1 when the size varies.
    exact: int
    #: The smallest valid size.
    minimum: int
    #: Bytes of the fixed part (SET_TENSOR's header), or -1 for "the whole payload" (FIXED, GRAPH_COMPUTE); the
    #: rest of a payload is bulk data.
    fixed: int


def request_frames(protocol: Protocol | None) -> dict[int, RequestFrame]:
    """Per command id of a version (HELLO and client-side sentinels excepted): how its requests are framed.  The
    framers use it, and so does the reference server's receive path, which reads the bytes itself."""
    table: dict[int, RequestFrame] = {}
    if protocol is None:
        return table
    for cmd, spec in protocol.commands.items():
        if cmd is Command.HELLO or cmd in NEVER_ON_WIRE:
            continue
        req, wire = spec.request, protocol.wire_id(cmd)
        if req.shape is Shape.FIXED:
            table[wire] = RequestFrame(cmd, req, req.header_size, req.header_size, -1)
        elif req.shape is Shape.HEADER_DATA:
            table[wire] = RequestFrame(cmd, req, -1, req.header_size, req.header_size)
        elif req.shape is Shape.GRAPH:
            table[wire] = RequestFrame(cmd, req, -1, req.header_size, -1)
    return table


def check_request_header(protocol: Protocol | None, cmd: int, size: int, off: int, *, hello_seen: bool,
                         max_payload: int = DEFAULT_MAX_PAYLOAD) -> Payload:
    """The request payload layout for a header, or the ProtocolError a decoder raises for it (``off``: the
    header's stream offset)."""
    name = protocol.command_name(cmd) if protocol is not None else command_name(cmd)
    if not hello_seen:
        if cmd != HELLO_ID:
            raise HandshakeError(f"the first command must be HELLO, got {name}", command=name, field="cmd",
                                 offset=off)
    elif cmd == HELLO_ID:
        raise HandshakeError("HELLO may be sent only once per connection", command=name, field="cmd", offset=off)
    if cmd == (protocol or V6).sentinel:
        raise UnknownCommand(f"command {cmd} ({name}) is a client-side sentinel, never sent", command=name,
                             field="cmd", offset=off)
    if protocol is None:
        if cmd != HELLO_ID:
            raise ProtocolError("protocol version unknown (no HELLO reply seen): cannot decode", command=name,
                                offset=off)
        protocol = V6
    spec = protocol.spec(cmd)
    if spec is None:
        raise UnknownCommand(f"command id {cmd} does not exist in protocol {protocol.label}", command=name,
                             field="cmd", offset=off)
    req = spec.request
    header_size = req.header_size
    if req.shape is Shape.FIXED and size != header_size:
        raise SizeMismatch(f"size {size}, but {name} is always {header_size} bytes", command=name,
                           field="size", offset=off + 1)
    if req.shape in (Shape.HEADER_DATA, Shape.GRAPH) and size < header_size:
        raise SizeMismatch(f"size {size} is below the minimum {header_size}", command=name, field="size",
                           offset=off + 1)
    if size > max_payload:
        raise SizeLimitExceeded(f"size claim {size} exceeds the limit {max_payload}", command=name,
                                field="size", offset=off + 1)
    return req


__all__ = ["HELLO_ID", "RequestFrame", "check_request_header", "request_frames"]
