"""Sans-IO codec: messages to bytes and bytes (in any chunks) to messages, for both directions.

Nothing here touches a socket.  Two modes share one framer (:mod:`.framing`):

* message mode -- :class:`RequestDecoder` / :class:`ReplyDecoder` hand back complete :class:`Request` /
  :class:`Reply` messages;
* streaming mode -- :class:`~.framing.RequestFramer` / :class:`~.framing.ReplyFramer` hand back a message's header
  and fixed fields as one event, then its bulk data as memoryview chunks, never buffered.

Replies carry no command id, so the reply side must be told, in order, which requests were sent
(:meth:`ReplyDecoder.expect`); it queues only those that have a reply, so a no-reply command is never waited for.

Size headers are claims: they are checked against the command's layout and against ``max_payload`` before any
memory is set aside.  Bulk data (SET_TENSOR data, GET_TENSOR replies) comes out as memoryview slices of what was
fed, without copies, whenever it arrived in one piece.  GRAPH_COMPUTE's tensors come out as one numpy structured
array whose dtype is derived from the construct declaration.  Payload encoding and decoding live in
:mod:`.payloads`, the content rules in :mod:`.checks`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .checks import check_request, check_tensor
from .decoded import Reply, Request
from .framing import Bulk, End, Head, ReplyFramer, RequestFramer, _Framer
from .payloads import (
    DEFAULT_MAX_PAYLOAD,
    REPLY_HEADER,
    REPLY_HEADER_SIZE,
    REQUEST_HEADER,
    REQUEST_HEADER_SIZE,
    TENSOR_DTYPE,
    TENSOR_LAYOUT,
    Buffer,
    decode_payload,
    encode_payload,
    encode_reply,
    encode_request,
    reply_parts,
    request_parts,
    tensors_array,
)
from .versions import Protocol, protocol_for


def _assemble(head: Head, parts: list[memoryview], end: End) -> tuple[memoryview, memoryview | None]:
    """A message's whole payload and its bulk data from the framer's events (copied only when it arrived in
    pieces)."""
    n_fixed = head.fixed.nbytes
    if end.raw is not None:
        raw = end.raw
    elif not parts:
        raw = head.fixed
    else:
        raw = memoryview(b"".join([head.fixed, *parts]))
    if head.bulk:
        return raw, raw[n_fixed:]
    return raw, head.trailing


class _MessageDecoder:
    """Message mode over a framer: collects one message's events into a message."""

    def __init__(self, framer: _Framer) -> None:
        self._framer = framer
        self._parts: list[memoryview] = []

    @property
    def protocol(self) -> Protocol | None:
        return self._framer.protocol

    @protocol.setter
    def protocol(self, value: Protocol | None) -> None:
        self._framer.protocol = value

    @property
    def max_payload(self) -> int:
        return self._framer.max_payload

    @property
    def offset(self) -> int:
        """Stream offset of the next undecoded byte."""
        return self._framer.offset

    @property
    def in_message(self) -> bool:
        return self._framer.in_message

    def receive_data(self, data: Buffer) -> None:
        """Queue bytes (kept by reference: do not reuse the buffer afterwards)."""
        self._framer.receive_data(data)

    def finish(self) -> None:
        """Declare the end of the stream: raises Truncated if it stopped inside a message."""
        self._framer.finish()  # type: ignore[attr-defined]

    def _next_end(self) -> tuple[Head, memoryview, memoryview | None] | None:
        framer = self._framer
        while (ev := framer.next_event()) is not None:
            if type(ev) is Bulk:
                self._parts.append(ev.data)
            elif type(ev) is End:
                head = ev.head
                parts, self._parts = self._parts, []
                raw, data = _assemble(head, parts, ev)
                return head, raw, data
            else:
                self._parts = []
        return None

    def feed(self, data: Buffer) -> list:
        """Add bytes and return every message they complete."""
        self.receive_data(data)
        out = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out

    def next_message(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


def request_of(head: Head, raw: memoryview, data: Any, *, validate: bool) -> Request:
    """The :class:`Request` a framed head, its raw bytes and its bulk data make (content rules checked with
    ``validate``): one construction for every decoder, whole-buffer or streaming."""
    req = Request(head.command, head.fields, data, head.size, head.offset, head.index, raw)
    if validate:
        check_request(req)
    return req


class RequestDecoder(_MessageDecoder):
    """Client -> server bytes to :class:`Request` messages.

    ``protocol`` may be None until the HELLO reply names it (auto-detection): only HELLO decodes until then.
    ``validate`` adds the content checks of :func:`check_request`.
    """

    def __init__(
        self,
        protocol: Protocol | None = None,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        validate: bool = True,
        expect_hello: bool = True,
    ) -> None:
        super().__init__(RequestFramer(protocol, max_payload=max_payload, expect_hello=expect_hello))
        self.validate = validate

    def next_message(self) -> Request | None:
        """The next complete request, or None until more bytes arrive."""
        got = self._next_end()
        if got is None:
            return None
        head, raw, data = got
        return request_of(head, raw, data, validate=self.validate)


class ReplyDecoder(_MessageDecoder):
    """Server -> client bytes to :class:`Reply` messages, paired with the requests that expect one."""

    def __init__(self, protocol: Protocol | None = None, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self._replies = ReplyFramer(protocol, max_payload=max_payload)
        super().__init__(self._replies)

    @property
    def awaiting(self) -> int:
        """Number of sent requests still waiting for their reply."""
        return self._replies.awaiting

    def expect(self, request: Request) -> bool:
        """Register a sent request; returns whether a reply will come for it."""
        return self._replies.expect(request)

    def next_message(self) -> Reply | None:
        got = self._next_end()
        if got is None:
            return None
        head, raw, data = got
        return Reply(head.command, head.fields, data, head.size, head.offset, head.index, head.request, raw)


def protocol_from_hello(fields: Mapping[str, Any]) -> Protocol | None:
    """The table matching a HELLO reply, or None for a version the kit does not cover."""
    return protocol_for(fields["major"], fields["minor"], fields["patch"])


__all__ = [
    "DEFAULT_MAX_PAYLOAD", "REPLY_HEADER", "REPLY_HEADER_SIZE", "REQUEST_HEADER", "REQUEST_HEADER_SIZE",
    "TENSOR_DTYPE", "TENSOR_LAYOUT", "Buffer", "Reply", "ReplyDecoder", "Request", "RequestDecoder",
    "check_request", "check_tensor", "decode_payload", "encode_payload", "encode_reply", "encode_request",
    "protocol_from_hello", "reply_parts", "request_of", "request_parts", "tensors_array",
]
