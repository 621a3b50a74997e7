"""A fuzzed request as values, and its bytes for either side (the model's addresses or the target's).

The same :class:`FuzzMessage` is encoded twice: once as drawn (the model's handles and addresses) and once through
a relocation function (the target's).  Wire-level breakage -- a lying size header, a cut message, a patched count,
another command byte -- is applied after encoding, identically on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ggml_rpc.spec import Command, Protocol, command_name
from ggml_rpc.spec.codec import REQUEST_HEADER, encode_payload

#: A size claim at most this far above the real payload is backed by zero bytes (the message stays whole);
#: a larger claim is sent as is and the connection is then ended (the server must not wait for the rest).
PAD_LIMIT = 4096

#: Request fields that carry server-assigned values (handles, addresses): see :class:`~..sessions.relocate.Relocator`.
_RELOCATED = ("remote_ptr", "tensor", "src", "dst", "op", "srcs", "tensors")

Relocate = Callable[[dict[str, Any]], dict[str, Any]]
_UID_COMMANDS = (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)


@dataclass(slots=True)
class FuzzMessage:
    """One request: the layout it is built from, and what (if anything) is broken on purpose."""

    command: Command
    fields: dict[str, Any]
    data: bytes | None = None
    #: Command byte on the wire when it is not ``command`` (an id the version does not have).
    wire_command: int | None = None
    #: Size header claim when it is not the payload length.
    size: int | None = None
    #: Send only this many bytes of the message, then end the connection.
    cut: int | None = None
    #: (payload offset, bytes) written over the encoded payload (a count that lies).
    patch: tuple[int, bytes] | None = None
    #: The flaw put in on purpose ("bound: tensor.data past its buffer"), None for a valid message.
    broken: str | None = None
    #: Free-form labels for statistics.
    tags: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        if self.wire_command is not None and self.wire_command != int(self.command):
            return command_name(self.wire_command)
        return self.command.name

    def describe(self) -> str:
        text = self.name
        if self.broken:
            text += f" [{self.broken}]"
        return text

    def encode(self, protocol: Protocol, relocate: Relocate | None = None) -> tuple[bytes, bool]:
        """(bytes to send, whether the connection ends after them)."""
        spec = protocol.commands.get(self.command)
        if spec is None:
            raise KeyError(f"{self.command.name} is not a command of protocol {protocol.label}")
        fields = relocate(self.fields) if relocate is not None else self.fields
        if protocol.graph_cache_max is not None and "uid" not in fields and self.command in _UID_COMMANDS:
            # A graph message written without a uid (the hunt's strategies predate 8.0.0) names graph 1.
            fields = {**fields, "uid": 1}
        parts = encode_payload(spec.request, fields, self.data)
        cmd = protocol.wire_id(self.command) if self.wire_command is None else self.wire_command
        if self.patch is None and self.size is None and self.cut is None:
            # The common case (nothing broken at the wire level): header and parts joined in one copy.
            n = sum(memoryview(p).nbytes for p in parts)
            return b"".join((REQUEST_HEADER.pack(cmd, n), *parts)), False
        payload = bytearray(b"".join(parts))
        if self.patch is not None:
            at, raw = self.patch
            payload[at : at + len(raw)] = raw
        end = False
        claim = len(payload) if self.size is None else self.size
        if claim <= len(payload):
            body = bytes(payload[:claim])
        elif claim - len(payload) <= PAD_LIMIT:
            body = bytes(payload) + bytes(claim - len(payload))
        else:
            body = bytes(payload)
            end = True
        wire = REQUEST_HEADER.pack(cmd, claim) + body
        if self.cut is not None and self.cut < len(wire):
            wire = wire[: self.cut]
            end = True
        return wire, end

    @property
    def relocatable(self) -> bool:
        """Does the message name a buffer handle or a tensor (its bytes differ between the model and the target)?"""
        return any(key in self.fields for key in _RELOCATED)
