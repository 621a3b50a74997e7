"""Decoding captured sessions: both directions of a connection, replies paired with their requests, in bounded
memory.

The version is learnt from each connection's HELLO reply unless the caller forces one.  Decoding stops at the
first spec violation and records it with the connection, message index and byte offset.

Each direction is fed from its capture stream (:class:`~.spans.Stream`) to the spec's streaming framers a window
at a time; bulk data the framer does not need (SET_TENSOR data, GET_TENSOR replies, 2-D rows) is skipped, never
read.  A message with bulk data keeps it as a :class:`~.spans.LazyBytes` (a range of the stream: read, hashed or
sent in pieces when asked); fixed parts are copied out of the window, so a message holds nothing of the stream.
:func:`iter_connection` yields the messages in wire order (each request followed by its reply) as they are decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ggml_rpc.spec import (
    REPLY_HEADER_SIZE,
    REQUEST_HEADER_SIZE,
    Command,
    Direction,
    Protocol,
    ProtocolError,
    Reply,
    Request,
    fnv1a64,
    protocol_from_hello,
    tensor_name,
    type_name,
)
from ggml_rpc.spec.codec import request_of
from ggml_rpc.spec.framing import End, Head, ReplyFramer, RequestFramer, _Framer
from ggml_rpc.spec.versions import V6

from .capture import Connection, read_connections
from .decoded import DecodedConnection
from .peer_link import decode_with_links
from .spans import Stream
from .truncation import reply_cut, request_cut

#: Stream bytes fed to a framer at once.
FEED = 1 << 20


class _Feed:
    """One direction fed to a framer from its stream; bulk data beyond the fed window is skipped, never read."""

    def __init__(self, framer: _Framer, stream: Stream, header: int) -> None:
        self.framer, self.stream, self.header = framer, stream, header
        self.pos = 0
        self._head: Head | None = None

    @property
    def in_message(self) -> bool:
        return self.framer.in_message or self.pos < self.stream.size

    def _event(self) -> Any:
        framer, stream = self.framer, self.stream
        while True:
            ev = framer.next_event()
            if ev is not None:
                return ev
            ahead = framer.bulk_ahead()
            if ahead:
                n = min(ahead, stream.size - self.pos)
                if not n:
                    return None
                framer.skip(n)
                self.pos += n
                continue
            if self.pos >= stream.size:
                return None
            stop = min(self.pos + FEED, stream.size)
            for view in stream.chunks(self.pos, stop):
                framer.receive_data(view)
            self.pos = stop

    def next_message(self) -> tuple[Head, Any, Any] | None:
        """(head, raw payload, data) of the next complete message, or None at the end of what the stream holds."""
        while (ev := self._event()) is not None:
            if type(ev) is Head:
                # A copy of the fixed part: a view would keep the whole fed window alive with the message.
                ev.fixed = memoryview(bytes(ev.fixed))
                self._head = ev
            elif type(ev) is End:
                head = ev.head
                start = head.offset + self.header
                _ = head.fields  # decoded now: raises for a fixed part its layout refuses
                if head.bulk:
                    return head, self.stream.view(start, start + head.size), \
                        self.stream.view(start + head.size - head.bulk, start + head.size)
                return head, head.fixed, head.trailing
        return None


class _Requests(_Feed):
    def __init__(self, stream: Stream, protocol: Protocol | None, validate: bool, expect_hello: bool) -> None:
        super().__init__(RequestFramer(protocol, expect_hello=expect_hello), stream, REQUEST_HEADER_SIZE)
        self.validate = validate

    def next(self) -> Request | None:
        got = self.next_message()
        if got is None:
            return None
        head, raw, data = got
        return request_of(head, raw, data, validate=self.validate)


class _Replies(_Feed):
    def __init__(self, stream: Stream, protocol: Protocol | None) -> None:
        self.replies = ReplyFramer(protocol)
        super().__init__(self.replies, stream, REPLY_HEADER_SIZE)

    def next(self) -> Reply | None:
        got = self.next_message()
        if got is None:
            return None
        head, raw, data = got
        return Reply(head.command, head.fields, data, head.size, head.offset, head.index, head.request, raw)


def iter_connection(conn: Connection, protocol: Protocol | None = None, *, validate: bool = True,
                    out: DecodedConnection | None = None,
                    keep: Callable[[Request | Reply], bool] | None = None) -> Iterator[Request | Reply]:
    """Decode one connection as it is read, yielding each request and then its reply (when the capture holds it).

    ``out`` (a :class:`DecodedConnection` for ``conn``) collects the messages ``keep`` accepts (all by default),
    the version and the error or notes, as :func:`decode_connection` returns them.
    """
    forced = protocol is not None
    if out is None:
        out = DecodedConnection(conn, protocol, notes=list(conn.notes))
    kept = keep or (lambda _msg: True)
    if not conn.saw_syn and protocol is None:
        out.error = ProtocolError("capture starts mid-connection and no --proto was given: version unknown")
        out.error_direction = Direction.C2S
        return
    reqs = _Requests(conn.c2s.stream, protocol, validate, conn.saw_syn)
    reps = _Replies(conn.s2c.stream, protocol)
    server_error: ProtocolError | None = None
    framed = 0  # requests decoded: the index a request cut inside its header would have had

    def reply() -> Reply | None:
        # The server's stream is read as far as the requests so far make replies due: a broken one stops there.
        nonlocal server_error
        if server_error is not None:
            return None
        try:
            rep = reps.next()
        except ProtocolError as exc:
            server_error = exc
            return None
        if rep is not None and kept(rep):
            out.replies.append(rep)
        return rep

    try:
        while True:
            req = reqs.next()
            if req is None:
                break
            framed = req.index + 1
            if kept(req):
                out.requests.append(req)
            yield req
            waits = reps.replies.expect(req)
            if req.command is Command.HELLO and waits:
                # The HELLO reply decides how every later request is read.
                # (read in this block: a HELLO reply that does not decode stops the requests, as it always has)
                rep = reps.next()
                if rep is None:
                    out.notes.append("no HELLO reply in the capture")
                    break
                if kept(rep):
                    out.replies.append(rep)
                yield rep
                f = rep.fields
                out.announced = (f["major"], f["minor"], f["patch"])
                learnt = protocol_from_hello(f)
                if not forced:
                    if learnt is None:
                        out.error = ProtocolError(
                            f"server announces {f['major']}.{f['minor']}.{f['patch']}: not covered by this kit",
                            command="HELLO",
                        )
                        out.error_direction = Direction.S2C
                        return
                    out.protocol = learnt
                    reqs.framer.protocol = learnt
                    reps.framer.protocol = learnt
            elif waits and (rep := reply()) is not None:
                yield rep
        if conn.c2s.gap_at is None and not reqs.in_message:
            reqs.framer.finish()  # type: ignore[attr-defined]
        elif reqs.in_message and conn.c2s.cut and conn.c2s.gap_at is None:
            out.cuts.append(request_cut(conn.index, reqs.framer, framed, conn.c2s.size))
        elif reqs.in_message:
            out.notes.append(f"{Direction.C2S} stream ends inside a message at byte {reqs.framer.offset}")
    except ProtocolError as exc:
        out.error, out.error_direction = exc, Direction.C2S
    # Replies to the requests decoded so far are still read, also when the client stream broke the spec later:
    # a replayer needs them to know what the server answered before the offending message.
    try:
        if server_error is not None:
            raise server_error
        while (rep := reps.next()) is not None:
            if kept(rep):
                out.replies.append(rep)
            yield rep
        if conn.s2c.cut and conn.s2c.gap_at is None and (cut := reply_cut(conn.index, reps.replies,
                                                                             conn.s2c.size)) is not None:
            out.cuts.append(cut)  # the capture stopped, not the server: no "no reply before the end" either
        elif reps.replies.awaiting and conn.s2c.gap_at is None:
            reps.replies.finish()
            out.notes.append(f"{reps.replies.awaiting} request(s) got no reply before the connection ended")
    except ProtocolError as exc:
        if out.error is None:
            out.error, out.error_direction = exc, Direction.S2C
        else:
            out.notes.append(f"{Direction.S2C} stream also breaks the spec: {exc}")


def decode_connection(
    conn: Connection, protocol: Protocol | None = None, *, validate: bool = True
) -> DecodedConnection:
    """Decode both streams of one connection; ``protocol`` None means: learn it from the HELLO reply."""
    out = DecodedConnection(conn, protocol, notes=list(conn.notes))
    for _msg in iter_connection(conn, protocol, validate=validate, out=out):
        pass
    return out


def decode_file(path: str | Path, protocol: Protocol | None = None, *, port: int | None = None,
                validate: bool = True) -> list[DecodedConnection]:
    """Decode every connection of a capture (8.0.0 servers' links included, see :mod:`.peer_link`)."""
    return decode_with_links(read_connections(path, port=port),
                             lambda c: decode_connection(c, protocol, validate=validate))


# ---- one-line and JSON descriptions ----------------------------------------------------------------------------


def _tensor_summary(t: dict[str, Any]) -> str:
    name = tensor_name(t["name"]) or f"id={t['id']:#x}"
    ne = ",".join(str(x) for x in t["ne"])
    return f"{name} {type_name(t['type'])}[{ne}]"


def summarize(msg: Request | Reply) -> dict[str, Any]:
    """The key fields of a message as a flat JSON-ready dict."""
    f = msg.fields
    d: dict[str, Any] = {"command": msg.command.name, "size": msg.size, "offset": msg.offset}
    cmd = msg.command
    if isinstance(msg, Request):
        if "tensor" in f:
            t = f["tensor"]
            d["tensor"] = tensor_name(t["name"])
            d["type"] = type_name(t["type"])
            d["ne"] = list(t["ne"])
            d["data_ptr"] = t["data"]
        for key in ("device", "uid", "size", "offset", "n_copies", "stride", "remote_ptr", "value", "cache_flag",
                    "hash", "rank", "world", "port"):
            if key in f:
                d["req_" + key if key == "size" else key] = f[key]
        if cmd in (Command.SET_TENSOR, Command.SET_TENSOR_2D):
            d["bytes"] = msg.data.nbytes if msg.data is not None else 0
        if cmd is Command.COMM_INIT:
            d["host"] = bytes(f["host"]).split(b"\0", 1)[0].decode("latin-1")
        if cmd is Command.COPY_TENSOR:
            d["src"] = tensor_name(f["src"]["name"])
            d["dst"] = tensor_name(f["dst"]["name"])
        if cmd is Command.GRAPH_COMPUTE:
            d["n_nodes"] = f["n_nodes"]
            d["n_tensors"] = f["n_tensors"]
    else:
        for key, value in f.items():
            if isinstance(value, bytes | bytearray):
                d[key] = bytes(value).hex()
            else:
                d[key] = value
        if cmd in (Command.GET_TENSOR, Command.GET_TENSOR_2D) and msg.data is not None:
            d["bytes"] = msg.data.nbytes
    return d


def describe(msg: Request | Reply) -> str:
    """A human-readable one-liner for a message."""
    f = msg.fields
    cmd = msg.command
    parts: list[str] = []
    if isinstance(msg, Request):
        if "tensor" in f:
            parts.append(_tensor_summary(f["tensor"]))
        if cmd is Command.COPY_TENSOR:
            parts.append(f"{_tensor_summary(f['src'])} -> {_tensor_summary(f['dst'])}")
        if cmd is Command.SET_TENSOR:
            parts.append(f"offset={f['offset']} bytes={msg.data.nbytes if msg.data is not None else 0}")
            if "cache_flag" in f:
                parts.append(f"cache_flag={f['cache_flag']}")
        elif cmd is Command.SET_TENSOR_HASH:
            parts.append(f"offset={f['offset']} hash={f['hash']:016x}")
        elif cmd in (Command.GET_TENSOR, Command.MEMSET_TENSOR):
            parts.append(f"offset={f['offset']} size={f['size']}")
            if cmd is Command.MEMSET_TENSOR:
                parts.append(f"value={f['value']}")
        elif cmd is Command.ALLOC_BUFFER:
            parts.append(f"device={f['device']} size={f['size']}")
        elif cmd is Command.GRAPH_COMPUTE:
            uid = f" uid={f['uid']}" if "uid" in f else ""
            parts.append(f"device={f['device']}{uid} n_nodes={f['n_nodes']} n_tensors={f['n_tensors']}")
        elif cmd is Command.GRAPH_RECOMPUTE and "uid" in f:
            parts.append(f"device={f['device']} uid={f['uid']}")
        elif cmd in (Command.SET_TENSOR_2D, Command.GET_TENSOR_2D):
            parts.append(f"offset={f['offset']} rows={f['n_copies']}x{f['size']} stride={f['stride']}")
        elif cmd is Command.COMM_INIT:
            host = bytes(f["host"]).split(b"\0", 1)[0].decode("latin-1")
            peer = f"listens on port {f['port']}" if f["rank"] == 0 else f"connects to {host}:{f['port']}"
            parts.append(f"device={f['device']} rank={f['rank']}/{f['world']} {peer}")
        elif "remote_ptr" in f:
            parts.append(f"buffer={f['remote_ptr']:#x}")
            if "value" in f:
                parts.append(f"value={f['value']}")
        elif "device" in f:
            parts.append(f"device={f['device']}")
    else:
        if cmd is Command.HELLO:
            parts.append(f"version={f['major']}.{f['minor']}.{f['patch']}")
        elif cmd is Command.SET_TENSOR_HASH:
            parts.append("hit" if f["result"] else "miss")
        elif cmd in (Command.GET_TENSOR, Command.GET_TENSOR_2D):
            n = msg.data.nbytes if msg.data is not None else 0
            parts.append(f"bytes={n} fnv1a={fnv1a64(msg.data) if msg.data is not None else 0:016x}")
        else:
            for key, value in f.items():
                parts.append(f"{key}={value:#x}" if key in ("remote_ptr", "base_ptr") else f"{key}={value}")
    return f"{cmd.name} {' '.join(parts)}".rstrip()


def default_protocol() -> Protocol:
    return V6
