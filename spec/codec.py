"""Sans-IO codec: messages to bytes and bytes (in any chunks) to messages, for both directions.

Nothing here touches a socket.  Feed the decoders whatever arrived; they hand back complete messages.  Replies
carry no command id, so :class:`ReplyDecoder` must be told, in order, which requests were sent
(:meth:`ReplyDecoder.expect`); it queues only those that have a reply, so a no-reply command is never waited for.

Size headers are claims: they are checked against the command's layout and against ``max_payload`` before any
memory is set aside.  Bulk data (SET_TENSOR data, GET_TENSOR replies) comes out as memoryview slices of what was
fed, without copies, whenever it arrived in one piece.  GRAPH_COMPUTE's tensors come out as one numpy structured
array whose dtype is derived from the construct declaration.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import schema_walk
from .enums import GGML_TYPE_COUNT, NEVER_ON_WIRE, TYPES, Command, command_name
from .errors import (
    EncodeError,
    HandshakeError,
    ProtocolError,
    SizeLimitExceeded,
    SizeMismatch,
    SpecViolation,
    Truncated,
    UnexpectedReply,
    UnknownCommand,
)
from .facts import ggml_nbytes
from .layout import flat_layout, numpy_dtype
from .messages import GRAPH_MIN_SIZE, Payload, Shape
from .tensor import RPC_TENSOR_SIZE, RpcTensor
from .versions import PROTOCOLS, Protocol, protocol_for

#: Default cap on a single payload claim (4 GiB): above it a decoder refuses instead of allocating.
DEFAULT_MAX_PAYLOAD = 1 << 32

REQUEST_HEADER = struct.Struct("<BQ")
REPLY_HEADER = struct.Struct("<Q")
REQUEST_HEADER_SIZE = REQUEST_HEADER.size  # 9
REPLY_HEADER_SIZE = REPLY_HEADER.size  # 8

#: numpy dtype of one rpc_tensor, derived from the construct Struct.
TENSOR_DTYPE = numpy_dtype(RpcTensor)
TENSOR_LAYOUT = flat_layout(RpcTensor)

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True, eq=False)
class Request:
    """One decoded request."""

    command: Command
    fields: dict[str, Any]
    #: Bulk bytes: SET_TENSOR data, or trailing bytes after a GRAPH_COMPUTE; None otherwise.
    data: memoryview | None = None
    size: int = 0
    #: Byte offset of the command byte in the decoded stream.
    offset: int = 0
    index: int = 0
    raw: memoryview = field(default_factory=lambda: memoryview(b""))

    @property
    def wire_size(self) -> int:
        return REQUEST_HEADER_SIZE + self.size


@dataclass(slots=True, eq=False)
class Reply:
    """One decoded reply, paired with the request it answers."""

    command: Command
    fields: dict[str, Any]
    data: memoryview | None = None
    size: int = 0
    offset: int = 0
    index: int = 0
    request: Request | None = None
    raw: memoryview = field(default_factory=lambda: memoryview(b""))

    @property
    def wire_size(self) -> int:
        return REPLY_HEADER_SIZE + self.size


# ---- payloads --------------------------------------------------------------------------------------------------


def tensors_array(tensors: Iterable[Mapping[str, Any]] | np.ndarray) -> np.ndarray:
    """A structured array of rpc_tensors from dicts (or the array itself)."""
    if isinstance(tensors, np.ndarray):
        if tensors.dtype != TENSOR_DTYPE:
            raise TypeError("tensor array has the wrong dtype")
        return tensors
    items = list(tensors)
    buf = bytearray(RPC_TENSOR_SIZE * len(items))
    for i, t in enumerate(items):
        TENSOR_LAYOUT.pack_into(buf, i * RPC_TENSOR_SIZE, t)
    return np.frombuffer(buf, dtype=TENSOR_DTYPE).copy() if items else np.zeros(0, TENSOR_DTYPE)


def encode_payload(payload: Payload, fields: Mapping[str, Any] | None, data: Buffer | None = None) -> list[Buffer]:
    """The payload bytes of one message, as parts (bulk data is passed through, not copied)."""
    fields = fields or {}
    if payload.shape is Shape.FIXED:
        return [flat_layout(payload.schema).pack(dict(fields))]
    if payload.shape is Shape.HEADER_DATA:
        head = flat_layout(payload.schema).pack(dict(fields))
        return [head, data] if data is not None and len(data) else [head]
    if payload.shape is Shape.RAW:
        return [data if data is not None else b""]
    nodes = np.asarray(fields["nodes"], dtype="<u8")
    tensors = tensors_array(fields["tensors"])
    parts: list[Buffer] = [
        struct.pack("<II", fields["device"], len(nodes)),
        nodes.tobytes(),
        struct.pack("<I", len(tensors)),
        tensors.tobytes(),
    ]
    if data is not None and len(data):
        parts.append(data)
    return parts


def _encode_checked(
    payload: Payload, fields: Mapping[str, Any] | None, data: Buffer | None, command: Command | int
) -> list[Buffer]:
    """encode_payload with a typed error naming the command for values that do not fit their fields."""
    try:
        return encode_payload(payload, fields, data)
    except (struct.error, OverflowError, KeyError, TypeError, ValueError) as exc:
        missing = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise EncodeError(f"cannot encode: {missing}", command=command_name(command)) from exc


def _parts_size(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def request_parts(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> list[Buffer]:
    """A request as a list of buffers for ``sendmsg`` (header first, bulk data not copied)."""
    spec = protocol.spec(command)
    if spec is None:
        raise UnknownCommand(f"not a command of protocol {protocol.label}", command=command_name(command))
    body = _encode_checked(spec.request, fields, data, command)
    return [REQUEST_HEADER.pack(int(command), _parts_size(body)), *body]


def encode_request(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> bytes:
    """The bytes of one request."""
    parts = request_parts(protocol, command, fields, data)
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)


def reply_parts(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> list[Buffer]:
    """A reply as a list of buffers; raises for a command that has no reply in this version."""
    spec = protocol.spec(command)
    if spec is None or not spec.has_reply:
        raise ProtocolError(f"has no reply in protocol {protocol.label}", command=command_name(command))
    assert isinstance(spec.reply, Payload)
    body = _encode_checked(spec.reply, fields, data, command)
    return [REPLY_HEADER.pack(_parts_size(body)), *body]


def encode_reply(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> bytes:
    """The bytes of one reply (size header and payload)."""
    parts = reply_parts(protocol, command, fields, data)
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)


def decode_payload(payload: Payload, buf: memoryview, *, command: str, base: int = 0) -> tuple[dict, memoryview | None]:
    """Decode one complete payload; ``base`` is its offset in the stream (for error messages)."""
    size = buf.nbytes
    if payload.shape is Shape.FIXED:
        layout = flat_layout(payload.schema)
        if size != layout.size:
            raise SizeMismatch(f"payload is {size} bytes, the layout needs exactly {layout.size}", command=command,
                               field="size", offset=base)
        return layout.unpack(buf), None
    if payload.shape is Shape.HEADER_DATA:
        layout = flat_layout(payload.schema)
        if size < layout.size:
            raise SizeMismatch(f"payload is {size} bytes, shorter than its {layout.size}-byte header",
                               command=command, field="size", offset=base)
        return layout.unpack(buf), buf[layout.size :]
    if payload.shape is Shape.RAW:
        return {}, buf
    return _decode_graph(buf, command=command, base=base)


def _decode_graph(buf: memoryview, *, command: str, base: int) -> tuple[dict, memoryview | None]:
    size = buf.nbytes
    if size < 8:
        raise SizeMismatch(f"payload is {size} bytes; device and n_nodes need 8", command=command, field="n_nodes",
                           offset=base)
    device, n_nodes = struct.unpack_from("<II", buf, 0)
    nodes_end = 8 + 8 * n_nodes
    if size < nodes_end + 4:
        raise SizeMismatch(f"payload is {size} bytes; {n_nodes} node ids and n_tensors need {nodes_end + 4}",
                           command=command, field="nodes", offset=base + 8)
    (n_tensors,) = struct.unpack_from("<I", buf, nodes_end)
    end = nodes_end + 4 + RPC_TENSOR_SIZE * n_tensors
    if size < end:
        raise SizeMismatch(f"payload is {size} bytes; {n_tensors} tensors need {end}", command=command,
                           field="tensors", offset=base + nodes_end + 4)
    nodes = np.frombuffer(buf, dtype="<u8", count=n_nodes, offset=8)
    tensors = np.frombuffer(buf, dtype=TENSOR_DTYPE, count=n_tensors, offset=nodes_end + 4)
    fields = {"device": device, "n_nodes": n_nodes, "nodes": nodes, "n_tensors": n_tensors, "tensors": tensors}
    return fields, (buf[end:] if size > end else None)


# ---- semantic checks a decoder can make without server state ---------------------------------------------------


def check_tensor(tensor: Mapping[str, Any], *, command: str, field: str, offset: int) -> int:
    """Raise SpecViolation for a tensor every server refuses; return its nbytes."""
    t = tensor["type"]
    if t >= GGML_TYPE_COUNT:
        raise SpecViolation(f"type {t} is not a ggml type (< {GGML_TYPE_COUNT})", command=command,
                            field=f"{field}.type", offset=offset)
    if TYPES[t].removed:
        raise SpecViolation(f"type {t} ({TYPES[t].name}) was removed from ggml", command=command,
                            field=f"{field}.type", offset=offset)
    return ggml_nbytes(t, tensor["ne"], tensor["nb"])


_OFFSETS_CACHE: dict[tuple[Command, tuple[str, ...]], dict[str, int]] = {}


def _field_offset(req: Request, name: str) -> int:
    """Stream offset of a request field (up to the first variable-size one), for error reports only.

    Read from the spec Struct whose field names the request carries: versions differ in their fields (SET_TENSOR
    has cache_flag before offset since v7).
    """
    key = (req.command, tuple(req.fields))
    offsets = _OFFSETS_CACHE.get(key)
    if offsets is None:
        offsets = {}
        for p in PROTOCOLS:
            spec = p.commands.get(req.command)
            if spec is None or tuple(sub.name for sub in spec.request.schema.subcons) != key[1]:
                continue
            pos = 0
            for info in schema_walk.fields(spec.request.schema):
                offsets[info.name] = pos
                if info.variable:
                    break
                pos += info.length
            break
        _OFFSETS_CACHE[key] = offsets
    return req.offset + REQUEST_HEADER_SIZE + offsets.get(name, 0)


def check_request(req: Request) -> None:
    """Content rules of one request that hold whatever the server state (raise SpecViolation)."""
    name = req.command.name
    f = req.fields
    base = req.offset + REQUEST_HEADER_SIZE
    if req.command in (Command.SET_TENSOR, Command.GET_TENSOR, Command.MEMSET_TENSOR):
        nbytes = check_tensor(f["tensor"], command=name, field="tensor", offset=base)
        if req.command is Command.SET_TENSOR:
            n = req.data.nbytes if req.data is not None else 0
        else:
            n = f["size"]
        if n and f["offset"] + n > nbytes:
            raise SpecViolation(
                f"region offset {f['offset']} + {n} bytes runs past the tensor's {nbytes} bytes",
                command=name, field="offset", offset=_field_offset(req, "offset"),
            )
    elif req.command is Command.INIT_TENSOR:
        check_tensor(f["tensor"], command=name, field="tensor", offset=base)
    elif req.command is Command.COPY_TENSOR:
        src = check_tensor(f["src"], command=name, field="src", offset=base)
        check_tensor(f["dst"], command=name, field="dst", offset=_field_offset(req, "dst"))
        dst = ggml_nbytes(f["dst"]["type"], f["dst"]["ne"], f["dst"]["nb"])
        if src > dst:
            raise SpecViolation(f"copies {src} bytes into a {dst}-byte tensor", command=name, field="dst",
                                offset=_field_offset(req, "dst"))
    elif req.command is Command.GRAPH_COMPUTE:
        tensors = f["tensors"]
        if f["n_nodes"] == 0:
            raise SpecViolation("a graph without nodes", command=name, field="n_nodes",
                                offset=_field_offset(req, "n_nodes"))
        if len(tensors) and int(tensors["type"].max()) >= GGML_TYPE_COUNT:
            i = int(np.argmax(tensors["type"] >= GGML_TYPE_COUNT))
            raise SpecViolation(f"tensor {i} has type {int(tensors['type'][i])}", command=name,
                                field=f"tensors[{i}].type", offset=base)
        if np.any(f["nodes"] == 0):
            raise SpecViolation("node id 0 (a null node)", command=name, field="nodes",
                                offset=_field_offset(req, "nodes"))
        known = np.isin(f["nodes"], tensors["id"])
        if not np.all(known):
            i = int(np.argmin(known))
            raise SpecViolation(f"node id {int(f['nodes'][i]):#x} is not among the tensors", command=name,
                                field=f"nodes[{i}]", offset=_field_offset(req, "nodes") + f["nodes"].itemsize * i)


# ---- stream decoders -------------------------------------------------------------------------------------------


class _Stream:
    """Pending bytes as a queue of memoryviews; reads are zero-copy when they fall inside one chunk."""

    def __init__(self) -> None:
        self._chunks: deque[memoryview] = deque()
        self.pending = 0
        self.consumed = 0  # stream offset of the next unread byte

    def add(self, data: Buffer) -> None:
        mv = memoryview(data).cast("B")
        if mv.nbytes:
            self._chunks.append(mv)
            self.pending += mv.nbytes

    def peek(self, n: int) -> memoryview:
        """The next n bytes (n <= pending) without consuming them; copies only across chunk borders."""
        if n == 0:
            return memoryview(b"")
        first = self._chunks[0]
        if first.nbytes >= n:
            return first[:n]
        out = bytearray(n)
        pos = 0
        for chunk in self._chunks:
            take = min(n - pos, chunk.nbytes)
            out[pos : pos + take] = chunk[:take]
            pos += take
            if pos == n:
                break
        return memoryview(out)

    def take(self, n: int) -> memoryview:
        """Consume the next n bytes (n <= pending)."""
        view = self.peek(n)
        left = n
        while left:
            first = self._chunks[0]
            if first.nbytes <= left:
                left -= first.nbytes
                self._chunks.popleft()
            else:
                self._chunks[0] = first[left:]
                left = 0
        self.pending -= n
        self.consumed += n
        return view


class _StreamDecoder:
    """What both directions share: the pending bytes, the stream offset and the feed loop."""

    def __init__(self, protocol: Protocol | None, max_payload: int) -> None:
        self.protocol = protocol
        self.max_payload = max_payload
        self._stream = _Stream()
        self._index = 0

    @property
    def offset(self) -> int:
        """Stream offset of the next undecoded byte."""
        return self._stream.consumed

    def receive_data(self, data: Buffer) -> None:
        """Queue bytes (kept by reference: do not reuse the buffer afterwards)."""
        self._stream.add(data)

    def next_message(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def feed(self, data: Buffer) -> list:
        """Add bytes and return every message they complete."""
        self.receive_data(data)
        out = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out


class RequestDecoder(_StreamDecoder):
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
        super().__init__(protocol, max_payload)
        self.validate = validate
        self._hello_seen = not expect_hello
        self._header: tuple[int, int, int] | None = None  # (cmd, size, offset) of a message in progress

    @property
    def in_message(self) -> bool:
        return self._header is not None or self._stream.pending > 0

    def finish(self) -> None:
        """Declare the end of the stream: raises Truncated if it stopped inside a message."""
        if self._header is not None:
            cmd, size, off = self._header
            raise Truncated(f"stream ended {size - self._stream.pending} bytes short of a {size}-byte payload",
                            command=command_name(cmd), field="payload", offset=off)
        if self._stream.pending:
            raise Truncated(f"stream ended inside a request header ({self._stream.pending} of 9 bytes)",
                            offset=self._stream.consumed)

    def _check_header(self, cmd: int, size: int, off: int) -> Payload:
        name = command_name(cmd)
        if not self._hello_seen:
            if cmd != Command.HELLO:
                raise HandshakeError(f"the first command must be HELLO, got {name}", command=name, field="cmd",
                                     offset=off)
        elif cmd == Command.HELLO:
            raise HandshakeError("HELLO may be sent only once per connection", command=name, field="cmd", offset=off)
        if cmd in {int(c) for c in NEVER_ON_WIRE}:
            raise UnknownCommand(f"command {cmd} ({name}) is a client-side sentinel, never sent", command=name,
                                 field="cmd", offset=off)
        protocol = self.protocol
        if protocol is None:
            if cmd != Command.HELLO:
                raise ProtocolError("protocol version unknown (no HELLO reply seen): cannot decode", command=name,
                                    offset=off)
            from .versions import V6

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
            minimum = header_size if req.shape is Shape.HEADER_DATA else GRAPH_MIN_SIZE
            raise SizeMismatch(f"size {size} is below the minimum {minimum}", command=name, field="size",
                               offset=off + 1)
        if size > self.max_payload:
            raise SizeLimitExceeded(f"size claim {size} exceeds the limit {self.max_payload}", command=name,
                                    field="size", offset=off + 1)
        return req

    def next_message(self) -> Request | None:
        """The next complete request, or None until more bytes arrive."""
        s = self._stream
        if self._header is None:
            if s.pending < REQUEST_HEADER_SIZE:
                return None
            off = s.consumed
            cmd, size = REQUEST_HEADER.unpack(s.peek(REQUEST_HEADER_SIZE))
            self._check_header(cmd, size, off)
            s.take(REQUEST_HEADER_SIZE)
            self._header = (cmd, size, off)
        cmd, size, off = self._header
        if s.pending < size:
            return None
        body = s.take(size)
        self._header = None
        command = Command(cmd)
        assert self.protocol is not None or command is Command.HELLO
        from .versions import V6

        spec = (self.protocol or V6).commands[command]
        fields, data = decode_payload(spec.request, body, command=command.name, base=off + REQUEST_HEADER_SIZE)
        req = Request(command, fields, data, size, off, self._index, body)
        self._index += 1
        if command is Command.HELLO:
            self._hello_seen = True
        if self.validate:
            check_request(req)
        return req


class ReplyDecoder(_StreamDecoder):
    """Server -> client bytes to :class:`Reply` messages, paired with the requests that expect one."""

    def __init__(self, protocol: Protocol | None = None, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        super().__init__(protocol, max_payload)
        self._pending: deque[tuple[Request, Payload, int]] = deque()
        self._size: tuple[int, int] | None = None

    @property
    def awaiting(self) -> int:
        """Number of sent requests still waiting for their reply."""
        return len(self._pending)

    def expect(self, request: Request) -> bool:
        """Register a sent request; returns whether a reply will come for it."""
        from .versions import V6

        spec = (self.protocol or V6).spec(request.command)
        if spec is None or not spec.has_reply:
            return False
        assert isinstance(spec.reply, Payload)
        self._pending.append((request, spec.reply, spec.reply_size(request.fields)))
        return True

    def finish(self) -> None:
        """Declare the end of the stream: raises Truncated if it stopped inside a reply."""
        if self._size is not None:
            size, off = self._size
            raise Truncated(f"stream ended {size - self._stream.pending} bytes short of a {size}-byte reply",
                            command=self._pending[0][0].command.name, field="payload", offset=off)
        if self._stream.pending:
            raise Truncated(f"stream ended inside a reply header ({self._stream.pending} of 8 bytes)",
                            offset=self._stream.consumed)

    def next_message(self) -> Reply | None:
        s = self._stream
        if self._size is None:
            if s.pending < REPLY_HEADER_SIZE:
                return None
            off = s.consumed
            (size,) = REPLY_HEADER.unpack(s.peek(REPLY_HEADER_SIZE))
            if not self._pending:
                raise UnexpectedReply("reply bytes arrived while no request awaits a reply", field="size", offset=off)
            req, _payload, expected = self._pending[0]
            if size != expected:
                raise SizeMismatch(f"reply size {size}, expected {expected}", command=req.command.name,
                                   field="size", offset=off)
            if size > self.max_payload:
                raise SizeLimitExceeded(f"reply size claim {size} exceeds the limit {self.max_payload}",
                                        command=req.command.name, field="size", offset=off)
            s.take(REPLY_HEADER_SIZE)
            self._size = (size, off)
        size, off = self._size
        if s.pending < size:
            return None
        body = s.take(size)
        self._size = None
        req, payload, _ = self._pending.popleft()
        fields, data = decode_payload(payload, body, command=req.command.name, base=off + REPLY_HEADER_SIZE)
        reply = Reply(req.command, fields, data, size, off, self._index, req, body)
        self._index += 1
        if req.command is Command.HELLO and self.protocol is None:
            self.protocol = protocol_from_hello(fields)
        return reply


def protocol_from_hello(fields: Mapping[str, Any]) -> Protocol | None:
    """The table matching a HELLO reply, or None for a version the kit does not cover."""
    return protocol_for(fields["major"], fields["minor"], fields["patch"])
