"""What a reference connection sends: the reply queue its command groups write into (a connection's core takes
the queued buffers as one event).

Fixed-size replies are packed straight from their derived layout; a reply that never changes on a connection can be
encoded once (:meth:`Replies.encoded`) and queued as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggml_rpc.spec import Command, Payload, Protocol, encode_reply
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.messages import Shape


class Replies:
    """The buffers queued for the client, in order (views of tensor memory included, never copied)."""

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        self.out: list = []
        self._layouts: dict[Command, Any] = {
            cmd: flat_layout(spec.reply.schema)
            for cmd, spec in protocol.commands.items()
            if isinstance(spec.reply, Payload) and spec.reply.shape is Shape.FIXED
        }

    def encoded(self, command: Command, fields: Mapping[str, Any]) -> bytes | None:
        """The whole reply (size header included) when the command's reply is fixed-size, else None."""
        layout = self._layouts.get(command)
        if layout is None:
            return None
        body = layout.pack(fields)
        return REPLY_HEADER.pack(len(body)) + body

    def reply(self, command: Command, fields: Mapping[str, Any]) -> None:
        """Queue the reply of ``command`` with these fields."""
        encoded = self.encoded(command, fields)
        self.out.append(encode_reply(self.protocol, command, fields) if encoded is None else encoded)

    def push(self, part: bytes) -> None:
        """Queue one buffer (a reply encoded before)."""
        self.out.append(part)

    def send(self, parts: list) -> None:
        """Queue raw reply bytes (buffers, sent in order without a copy)."""
        self.out.extend(parts)

    def send_data(self, head: bytes, data: memoryview) -> None:
        """Queue a size header and the data it announces (a view of buffer memory)."""
        self.out.append(head)
        self.out.append(data)

    def take(self) -> list:
        """The queued buffers, leaving the queue empty."""
        out, self.out = self.out, []
        return out


__all__ = ["Replies"]
