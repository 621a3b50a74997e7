"""Streaming mode of the sans-IO codec: a message's header and fixed fields as one event, its bulk data as chunks.

The framers cut a byte stream (in any chunks) into messages without buffering bulk data:

* :class:`Head` -- the size header and the fixed part (every byte of a FIXED payload, SET_TENSOR's header, the whole
  of a GRAPH_COMPUTE); ``head.bulk`` says how many bulk bytes follow, ``head.fields`` decodes the fixed part (on first
  use, through the derived flat layout);
* :class:`Bulk` -- a memoryview slice of what was fed, valid until the caller reuses that buffer: forward it, write it
  to a pcap or hash it; the framer keeps no reference once :meth:`next_event` has returned None;
* :class:`End` -- the message is complete.

A caller that wants bulk bytes to land somewhere of its own (``recv_into`` a tensor's memory, ``splice``) asks
:meth:`~_Framer.bulk_ahead` how many it may take itself, takes them, and reports them with :meth:`~_Framer.skip`.

Size headers are claims, checked before anything is set aside; a fixed part is collected as it arrives (never
allocated from a claim).  Header errors lose the framing: the framer raises and stays broken.  The message-mode
decoders (:class:`~.codec.RequestDecoder`, :class:`~.codec.ReplyDecoder`) are built on these framers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .enums import Command
from .errors import ProtocolError, SizeLimitExceeded, SizeMismatch, Truncated, UnexpectedReply
from .frames import RequestFrame, check_request_header, request_frames
from .messages import Payload, Shape
from .payloads import (
    DEFAULT_MAX_PAYLOAD,
    REPLY_HEADER,
    REPLY_HEADER_SIZE,
    REQUEST_HEADER,
    REQUEST_HEADER_SIZE,
    Buffer,
    decode_payload,
)
from .versions import V6, Protocol, protocol_for

_EMPTY = memoryview(b"")


@dataclass(slots=True, eq=False)
class Head:
    """A message's size header and fixed part; ``bulk`` bytes of bulk data follow."""

    command: Command
    #: Payload bytes (fixed part and bulk), as the size header claims them.
    size: int
    #: Stream offset of the message's first byte (the command byte of a request, the size of a reply).
    offset: int
    index: int
    payload: Payload
    #: The fixed part's bytes (a slice of what was fed when it arrived in one piece, else a copy).
    fixed: memoryview
    bulk: int
    #: A reply's request (any object with ``command`` and ``fields``); None for a request.
    request: Any = None
    _fields: dict | None = None
    _trailing: memoryview | None = None
    #: Why the fixed part was not collected (larger than the framer's ``max_fixed``): it streams as bulk instead.
    error: ProtocolError | None = None

    @property
    def fields(self) -> dict:
        """The fixed part decoded (once); raises ProtocolError for a fixed part its layout refuses."""
        if self.error is not None:
            raise self.error
        if self._fields is None:
            header = REQUEST_HEADER_SIZE if self.request is None else REPLY_HEADER_SIZE
            self._fields, self._trailing = decode_payload(self.payload, self.fixed, command=self.command.name,
                                                          base=self.offset + header)
        return self._fields

    @property
    def trailing(self) -> memoryview | None:
        """Bytes after a GRAPH_COMPUTE's tensors, inside its fixed part (None if there are none)."""
        _ = self.fields
        return self._trailing


@dataclass(slots=True, eq=False)
class Bulk:
    """A piece of the current message's bulk data."""

    head: Head
    data: memoryview


@dataclass(slots=True, eq=False)
class End:
    """The message of ``head`` is complete; ``raw`` is its whole payload when it arrived in one fed chunk."""

    head: Head
    raw: memoryview | None


Event = Head | Bulk | End


class _Framer:
    """Bytes in, events out; what both directions share."""

    header_size = 0

    def __init__(self, protocol: Protocol | None, max_payload: int, max_fixed: int) -> None:
        self.protocol = protocol
        self.max_payload = max_payload
        self.max_fixed = max_fixed
        self._chunks: deque[memoryview] = deque()
        self._pos = 0  # read position in the first queued chunk
        self._partial = bytearray()  # a header or fixed part that spans chunks, copied as it arrives
        self._consumed = 0  # stream offset of the next unread byte
        self._start = 0  # stream offset of the current (or next) message
        self._head: Head | None = None
        self._need_fixed = 0
        self._bulk_left = 0
        self._whole: tuple[memoryview, int] | None = None  # (chunk, payload start) while a message lies in one chunk
        self._building: Head | None = None  # a Head whose fixed part is still arriving
        self._index = 0
        self.broken: ProtocolError | None = None

    # ---- what the caller sees ----------------------------------------------------------------------------------

    @property
    def offset(self) -> int:
        """Stream offset of the next byte a message-mode decoder has not consumed (header start, or payload start
        while inside a message)."""
        return self._start + (self.header_size if self.unfinished is not None else 0)

    @property
    def in_message(self) -> bool:
        return self.unfinished is not None or bool(self._partial) or bool(self._chunks)

    @property
    def current(self) -> Head | None:
        """The message being framed (its Head has been returned), or None between messages."""
        return self._head

    @property
    def unfinished(self) -> Head | None:
        """The message being framed, also while its fixed part arrives: what a stream cut here leaves incomplete."""
        return self._head or self._building

    def receive_data(self, data: Buffer) -> None:
        """Queue bytes; they are referenced until :meth:`next_event` returns None, copied only where a header or
        fixed part spans chunks."""
        if self.broken is not None:
            return
        mv = memoryview(data).cast("B")
        if mv.nbytes:
            self._chunks.append(mv)

    def bulk_ahead(self) -> int:
        """Bulk bytes of the current message that have not been fed: the caller may read them itself, then call
        :meth:`skip`.  0 while queued bytes wait for :meth:`next_event`."""
        if self._head is None or self._chunks or self.broken is not None:
            return 0
        return self._bulk_left

    def skip(self, n: int) -> None:
        """``n`` bulk bytes (at most :meth:`bulk_ahead`) the caller took itself; the End follows from next_event."""
        if n > self.bulk_ahead():
            raise ValueError(f"skip({n}) past the {self.bulk_ahead()} bulk bytes ahead")
        self._bulk_left -= n
        self._consumed += n
        self._whole = None

    def events(self, data: Buffer) -> list[Event]:
        """Feed bytes and return every event they complete (the events' views are valid while ``data`` is)."""
        self.receive_data(data)
        out = []
        while (ev := self.next_event()) is not None:
            out.append(ev)
        return out

    def next_event(self) -> Event | None:
        """The next event, or None until more bytes arrive; raises ProtocolError where the framing is lost."""
        if self.broken is not None:
            raise self.broken
        head = self._head
        if head is not None:
            if not self._bulk_left:
                return self._end(head)
            if not self._chunks:
                return None
            chunk = self._chunks[0]
            self._same_chunk(chunk)
            take = min(self._bulk_left, chunk.nbytes - self._pos)
            data = chunk[self._pos : self._pos + take]
            self._advance(take)
            self._bulk_left -= take
            return Bulk(head, data)
        building = self._building
        while self._chunks:
            chunk = self._chunks[0]
            pos = self._pos
            avail = chunk.nbytes - pos
            if building is None:
                need = self.header_size - len(self._partial)
                if avail < need:
                    self._partial += chunk[pos:]
                    self._advance(avail)
                    continue
                if self._partial:
                    self._partial += chunk[pos : pos + need]
                    header, self._partial = memoryview(bytes(self._partial)), bytearray()
                else:
                    header = chunk[pos : pos + need]
                try:
                    building = self._begin(header)
                except ProtocolError as exc:
                    self.broken = exc
                    raise
                # The payload lies in this chunk from here on (checked as it is read).
                self._whole = (chunk, pos + need) if pos + need < chunk.nbytes or not building.size else None
                self._advance(need)
                if not self._need_fixed:
                    self._head = building
                    return building
                self._building = building
                continue
            self._same_chunk(chunk)
            need = self._need_fixed - len(self._partial)
            if avail < need:
                self._partial += chunk[pos:]
                self._advance(avail)
                continue
            if self._partial:
                self._partial += chunk[pos : pos + need]
                building.fixed, self._partial = memoryview(self._partial), bytearray()
            else:
                building.fixed = chunk[pos : pos + need]
            self._advance(need)
            self._need_fixed = 0
            self._building = None
            self._head = building
            return building
        return None

    # ---- internals ---------------------------------------------------------------------------------------------

    def _same_chunk(self, chunk: memoryview) -> None:
        if self._whole is not None and self._whole[0] is not chunk:
            self._whole = None

    def _advance(self, n: int) -> None:
        self._pos += n
        self._consumed += n
        if self._pos == self._chunks[0].nbytes:
            self._chunks.popleft()
            self._pos = 0

    def _end(self, head: Head) -> End:
        raw = None
        if self._whole is not None:
            chunk, start = self._whole
            raw = chunk[start : start + head.size]
        self._head = None
        self._whole = None
        self._start = self._consumed
        self._finished(head)
        return End(head, raw)

    def _finished(self, head: Head) -> None:
        pass

    def _begin(self, header: memoryview) -> Head:  # pragma: no cover - overridden
        raise NotImplementedError

    def _open(self, command: Command, size: int, payload: Payload, fixed: int, request: Any) -> Head:
        """A Head for a checked header: ``fixed`` payload bytes are collected, the rest streams as bulk.  A fixed
        part above ``max_fixed`` is not collected: the whole payload streams as bulk and the Head carries the error
        (the framing is intact, only this message cannot be decoded)."""
        error = None
        if fixed > self.max_fixed:
            error = SizeLimitExceeded(f"a {fixed}-byte fixed part exceeds the limit {self.max_fixed}",
                                      command=command.name, field="size", offset=self._start)
            fixed = 0
        head = Head(command, size, self._start, self._index, payload, _EMPTY, size - fixed, request, error=error)
        self._index += 1
        self._need_fixed = fixed
        self._bulk_left = size - fixed
        return head


class RequestFramer(_Framer):
    """Client -> server bytes to events.  ``protocol`` may be None until the HELLO reply names it: only HELLO frames
    until then."""

    header_size = REQUEST_HEADER_SIZE

    def __init__(self, protocol: Protocol | None = None, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 max_fixed: int = DEFAULT_MAX_PAYLOAD, expect_hello: bool = True) -> None:
        super().__init__(protocol, max_payload, max_fixed)
        self.hello_seen = not expect_hello
        self._known: dict[int, RequestFrame] = {}
        self._known_for: Protocol | None = None

    def finish(self) -> None:
        """Declare the end of the stream: raises Truncated if it stopped inside a message."""
        head = self._head or self._building
        if head is not None:
            got = self._consumed - head.offset - REQUEST_HEADER_SIZE
            raise Truncated(f"stream ended {head.size - got} bytes short of a {head.size}-byte payload",
                            command=head.command.name, field="payload", offset=head.offset)
        if self._partial:
            raise Truncated(f"stream ended inside a request header ({len(self._partial)} of 9 bytes)",
                            offset=self._start)

    def _begin(self, header: memoryview) -> Head:
        cmd, size = REQUEST_HEADER.unpack(header)
        if self._known_for is not self.protocol:
            self._known = request_frames(self.protocol)
            self._known_for = self.protocol
        entry = self._known.get(cmd) if self.hello_seen else None
        if entry is not None and size <= self.max_payload:
            command, payload, exact, minimum, fixed = entry
            # The common case in one comparison each; anything else takes the full check for its error.
            if (size == exact) if exact >= 0 else (size >= minimum):
                return self._open(command, size, payload, size if fixed < 0 else fixed, None)
        payload = check_request_header(self.protocol, cmd, size, self._start, hello_seen=self.hello_seen,
                                       max_payload=self.max_payload)
        if payload.shape is Shape.FIXED or payload.shape is Shape.GRAPH:
            fixed = size
        elif payload.shape is Shape.HEADER_DATA:
            fixed = payload.header_size
        else:
            fixed = 0
        if cmd == Command.HELLO:
            self.hello_seen = True
        command = (self.protocol or V6).command_at(cmd)
        assert command is not None  # check_request_header raised for every id the version does not define
        return self._open(command, size, payload, fixed, None)


class ReplyFramer(_Framer):
    """Server -> client bytes to events, paired in order with the requests registered by :meth:`expect`."""

    header_size = REPLY_HEADER_SIZE

    def __init__(self, protocol: Protocol | None = None, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 max_fixed: int = DEFAULT_MAX_PAYLOAD) -> None:
        super().__init__(protocol, max_payload, max_fixed)
        self._pending: deque[tuple[Any, Payload, int]] = deque()

    @property
    def awaiting(self) -> int:
        """Number of sent requests still waiting for their reply."""
        return len(self._pending)

    @property
    def next_request(self) -> Any:
        """The request the next reply answers (None if none awaits one)."""
        return self._pending[0][0] if self._pending else None

    def expect(self, request: Any) -> bool:
        """Register a sent request (anything with ``command`` and ``fields``); returns whether a reply comes."""
        spec = (self.protocol or V6).spec(request.command)
        if spec is None or not spec.has_reply:
            return False
        assert isinstance(spec.reply, Payload)
        self._pending.append((request, spec.reply, spec.reply_size(request.fields)))
        return True

    def finish(self) -> None:
        """Declare the end of the stream: raises Truncated if it stopped inside a reply."""
        head = self._head or self._building
        if head is not None:
            got = self._consumed - head.offset - REPLY_HEADER_SIZE
            raise Truncated(f"stream ended {head.size - got} bytes short of a {head.size}-byte reply",
                            command=head.command.name, field="payload", offset=head.offset)
        if self._partial:
            raise Truncated(f"stream ended inside a reply header ({len(self._partial)} of 8 bytes)",
                            offset=self._start)

    def _begin(self, header: memoryview) -> Head:
        (size,) = REPLY_HEADER.unpack(header)
        off = self._start
        if not self._pending:
            raise UnexpectedReply("reply bytes arrived while no request awaits a reply", field="size", offset=off)
        req, payload, expected = self._pending[0]
        if size != expected:
            raise SizeMismatch(f"reply size {size}, expected {expected}", command=req.command.name,
                               field="size", offset=off)
        if size > self.max_payload:
            raise SizeLimitExceeded(f"reply size claim {size} exceeds the limit {self.max_payload}",
                                    command=req.command.name, field="size", offset=off)
        self._pending.popleft()
        fixed = 0 if payload.shape is Shape.RAW else size
        return self._open(req.command, size, payload, fixed, req)

    def _finished(self, head: Head) -> None:
        if head.command is Command.HELLO and self.protocol is None:
            f = head.fields
            self.protocol = protocol_for(f["major"], f["minor"], f["patch"])
