"""A deliberately broken server for the conformance tests: the reference server behind a fault-injecting relay.

Every conformance check must be able to fail.  Rather than patching the reference server's internals, each
"breaker" changes what the server does *on the wire*, which is all a black-box check can see: the relay reads
each request the client sends, lets the breaker decide (forward it as is or rewritten, answer it itself, swallow
it, close), forwards replies (possibly rewritten) and may inject bytes.  Seen from the client the pair is one
server that breaks exactly the rule the breaker targets.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.spec import Command, Protocol, ProtocolError, decode_payload, encode_request
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.messages import Payload, Shape

#: Payloads up to this size are read whole; bigger claims switch the connection to a plain byte relay.
RELAY_LIMIT = 64 << 20


class Gone(Exception):
    """One side closed."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except OSError as exc:
            raise Gone(str(exc)) from None
        if not k:
            raise Gone("closed")
        got += k
    return bytes(out)


@dataclass(slots=True)
class Msg:
    """One request as the relay saw it."""

    cmd: int
    size: int
    payload: bytes
    fields: dict[str, Any] | None
    data: bytes | None
    #: The command the id names in the relayed version (ids are per version: 19 is GET_TENSOR_2D in 8.0.0).
    command: Command | None = None

    @property
    def raw(self) -> bytes:
        return REQUEST_HEADER.pack(self.cmd, self.size) + self.payload


@dataclass(slots=True)
class Act:
    """What the relay does with one request."""

    #: Bytes sent upstream (None: the request is not forwarded).
    forward: bytes | None
    #: Bytes sent to the client after the (possible) reply.
    answer: bytes = b""
    #: Extra no-reply requests sent upstream after the forwarded one.
    then_upstream: tuple[bytes, ...] = ()
    close: bool = False
    #: The whole server goes away (listener and every connection), as an upstream process that aborts.
    die: bool = False


@dataclass
class Conn:
    """Per-client-connection state a breaker may read or keep notes in."""

    index: int
    protocol: Protocol
    cache_dir: Path | None
    #: handle -> [size, base] of every buffer allocated on this connection (base once asked for).
    buffers: dict[int, list[int]] = field(default_factory=dict)
    hellos: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


class Breaker:
    """No fault at all; subclasses override :meth:`request` and/or :meth:`reply`."""

    #: One upstream connection shared by every client (buffers outlive their client connection).
    shared_upstream = False
    #: A reply that cannot be delivered (the client closed first) takes the whole server down, as SIGPIPE does to
    #: upstream: replies then go out as two writes (size, body), like upstream's, so the second meets the reset.
    dies_on_lost_reply = False

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        return None

    def reply(self, conn: Conn, msg: Msg, body: bytes) -> bytes:
        """The reply payload (without its size header) the client gets."""
        return body


def decode(protocol: Protocol, cmd: int, payload: bytes) -> tuple[dict[str, Any] | None, bytes | None]:
    spec = protocol.spec(cmd) if cmd != protocol.sentinel else None
    if spec is None:
        return None, None
    req = spec.request
    try:
        if req.shape is Shape.FIXED:
            if len(payload) != req.header_size:
                return None, None
            return flat_layout(req.schema).unpack(payload), None
        fields, data = decode_payload(req, memoryview(payload), command=spec.command.name)
        return fields, bytes(data) if data is not None else None
    except (ProtocolError, ValueError):
        return None, None


def reply_payload(protocol: Protocol, msg: Msg) -> Payload | None:
    spec = protocol.spec(msg.cmd) if msg.cmd != protocol.sentinel else None
    if spec is None or not spec.has_reply:
        return None
    assert isinstance(spec.reply, Payload)
    return spec.reply


def fake_reply(protocol: Protocol, msg: Msg, fill: int = 0x41) -> bytes:
    """What a server that wrongly accepted ``msg`` might answer: a reply of the right size, filled with ``fill``
    (for a read: bytes that never were in any buffer); nothing for a command without reply."""
    payload = reply_payload(protocol, msg)
    if payload is None:
        return b""
    if payload.shape is Shape.RAW:
        n = payload.reply_length(msg.fields) if msg.fields else 16
        n = min(n, 1 << 20)
    else:
        n = payload.header_size
    return REPLY_HEADER.pack(n) + bytes([fill]) * n


class FaultyServer:
    """Listens on an ephemeral loopback port and relays to ``upstream`` through ``breaker``."""

    def __init__(self, upstream: tuple[str, int], protocol: Protocol, breaker: Breaker,
                 cache_dir: Path | None = None, port: int = 0) -> None:
        self.upstream = upstream
        self.protocol = protocol
        self.breaker = breaker
        self.cache_dir = cache_dir
        self.sock = socket.create_server(("127.0.0.1", port))
        self.host, self.port = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._index = 0
        self._shared: socket.socket | None = None
        self._shared_hello: bytes | None = None
        self._shared_lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> FaultyServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for s in [self.sock, *self._socks, *([self._shared] if self._shared else [])]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(timeout=5)

    def die(self) -> None:
        """Stop listening and drop every connection at once: what clients see of a process that aborted."""
        self._stop.set()
        for s in [self.sock, *self._socks, *([self._shared] if self._shared else [])]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        raise Gone("server died")

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self._index += 1
            self._socks.append(client)
            threading.Thread(target=self._serve, args=(client, self._index), daemon=True).start()

    def _upstream(self) -> socket.socket:
        s = socket.create_connection(self.upstream, timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks.append(s)
        return s

    def _serve(self, client: socket.socket, index: int) -> None:
        conn = Conn(index, self.protocol, self.cache_dir)
        shared = self.breaker.shared_upstream
        try:
            if shared:
                with self._shared_lock:
                    if self._shared is None:
                        self._shared = self._upstream()
                up = self._shared
            else:
                up = self._upstream()
        except OSError:
            client.close()
            return
        try:
            while True:
                header = recv_exact(client, 9)
                cmd, size = REQUEST_HEADER.unpack(header)
                if size > RELAY_LIMIT:
                    msg = Msg(cmd, size, b"", None, None, self.protocol.command_at(cmd))
                    act = self.breaker.request(conn, msg)
                    if act is not None and act.die:
                        self.die()
                    if act is not None and act.forward is None:
                        self._hold(client)
                        return
                    up.sendall(header)
                    self._pipe(client, up)
                    return
                payload = recv_exact(client, size)
                fields, data = decode(self.protocol, cmd, payload)
                msg = Msg(cmd, size, payload, fields, data, self.protocol.command_at(cmd))
                if shared:
                    with self._shared_lock:
                        self._one(conn, msg, client, up, shared=True)
                else:
                    self._one(conn, msg, client, up)
        except Gone:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.close()
            if not shared:
                with contextlib.suppress(OSError):
                    up.close()

    def _hold(self, client: socket.socket) -> None:
        """Swallow everything and never answer (a server waiting forever for a claimed payload)."""
        client.settimeout(30)
        with contextlib.suppress(OSError):
            while client.recv(65536):
                pass

    def _pipe(self, client: socket.socket, up: socket.socket) -> None:
        def one_way(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while chunk := a.recv(65536):
                    b.sendall(chunk)
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=one_way, args=(up, client), daemon=True)
        t.start()
        one_way(client, up)
        t.join(timeout=10)

    def _one(self, conn: Conn, msg: Msg, client: socket.socket, up: socket.socket, shared: bool = False) -> None:
        if msg.cmd == Command.HELLO:
            conn.hellos += 1
        if shared and msg.cmd == Command.HELLO and conn.hellos == 1 and self._shared_hello is not None:
            client.sendall(REPLY_HEADER.pack(len(self._shared_hello))
                           + self.breaker.reply(conn, msg, self._shared_hello))
            return
        act = self.breaker.request(conn, msg)
        if act is None:
            act = Act(forward=msg.raw)
        if act.close:
            raise Gone("breaker closed")
        if act.die:
            self.die()
        if act.forward is not None:
            try:
                up.sendall(act.forward)
            except OSError:
                raise Gone("upstream gone") from None
            fwd_cmd = act.forward[0]
            payload = reply_payload(self.protocol, Msg(fwd_cmd, 0, b"", msg.fields, None))
            if payload is not None:
                (n,) = REPLY_HEADER.unpack(recv_exact(up, 8))
                body = recv_exact(up, n)
                if msg.cmd == Command.HELLO and shared:
                    self._shared_hello = body
                if msg.cmd == Command.ALLOC_BUFFER and len(body) == 16:
                    handle, size = struct.unpack("<QQ", body)
                    conn.buffers[handle] = [size, 0]
                if msg.cmd == Command.BUFFER_GET_BASE and len(body) == 8 and msg.fields:
                    entry = conn.buffers.get(msg.fields["remote_ptr"])
                    if entry is not None:
                        entry[1] = struct.unpack("<Q", body)[0]
                body = self.breaker.reply(conn, msg, body)
                if self.breaker.dies_on_lost_reply:
                    try:
                        client.sendall(REPLY_HEADER.pack(len(body)))
                        client.sendall(body)
                    except OSError:
                        self.die()
                else:
                    client.sendall(REPLY_HEADER.pack(len(body)) + body)
            if msg.cmd == Command.FREE_BUFFER and msg.fields:
                conn.buffers.pop(msg.fields["remote_ptr"], None)
            for extra in act.then_upstream:
                up.sendall(extra)
        if act.answer:
            client.sendall(act.answer)


@contextlib.contextmanager
def faulty_server(upstream: tuple[str, int], protocol: Protocol, breaker: Breaker,
                  cache_dir: Path | None = None) -> Iterator[FaultyServer]:
    server = FaultyServer(upstream, protocol, breaker, cache_dir).start()
    try:
        yield server
    finally:
        server.stop()


# ---- breaker builders ----------------------------------------------------------------------------------------

Pred = Callable[[Conn, Msg], bool]


class AcceptBad(Breaker):
    """Requests matching ``pred`` are not forwarded: answered with a plausible fake reply (or silently ignored for
    commands without reply), and the connection stays open."""

    def __init__(self, pred: Pred, fill: int = 0x41) -> None:
        self.pred = pred
        self.fill = fill

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if self.pred(conn, msg):
            return Act(forward=None, answer=fake_reply(conn.protocol, msg, self.fill))
        return None


class Dies(Breaker):
    """The server dies (listener and connections gone) on requests matching ``pred``."""

    def __init__(self, pred: Pred) -> None:
        self.pred = pred

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        return Act(forward=None, die=True) if self.pred(conn, msg) else None


class DiesOnLostReply(Breaker):
    """The server dies when a client closed before its reply could be written (upstream: SIGPIPE)."""

    dies_on_lost_reply = True


class RewriteReply(Breaker):
    def __init__(self, cmd: int, fn: Callable[[Conn, Msg, bytes], bytes]) -> None:
        self.cmd = cmd
        self.fn = fn

    def reply(self, conn: Conn, msg: Msg, body: bytes) -> bytes:
        return self.fn(conn, msg, body) if msg.command == self.cmd else body


class RewriteRequest(Breaker):
    """Requests matching ``pred`` are forwarded after ``fn`` changed their fields (or data)."""

    def __init__(self, pred: Pred, fn: Callable[[Conn, Msg], tuple[dict, bytes | None]]) -> None:
        self.pred = pred
        self.fn = fn

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if msg.fields is not None and self.pred(conn, msg):
            fields, data = self.fn(conn, msg)
            assert msg.command is not None  # fields were decoded, so the version names the command
            return Act(forward=encode_request(conn.protocol, msg.command, fields, data))
        return None


class Inject(Breaker):
    """After a request matching ``pred`` is forwarded, ``extra`` bytes go to the client."""

    def __init__(self, pred: Pred, extra: bytes) -> None:
        self.pred = pred
        self.extra = extra

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        if self.pred(conn, msg):
            return Act(forward=msg.raw, answer=self.extra)
        return None


class Chain(Breaker):
    """Several breakers; the first that acts on a request wins, replies go through all of them."""

    def __init__(self, *parts: Breaker) -> None:
        self.parts = parts
        self.shared_upstream = any(p.shared_upstream for p in parts)

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        for p in self.parts:
            act = p.request(conn, msg)
            if act is not None:
                return act
        return None

    def reply(self, conn: Conn, msg: Msg, body: bytes) -> bytes:
        for p in self.parts:
            body = p.reply(conn, msg, body)
        return body
