"""The bytes of a check's exchange: every connection the check opens through :meth:`Context.connect` is recorded
(both directions, in order, with the time of each write), so a failing check can be written as a pcap with real TCP
framing (``--pcap-dir``) and its messages decoded by the spec for the HTML report.

Recording is bounded: at most :data:`BUDGET` bytes per check are kept (a check that uploads 256 MiB keeps its
first bytes and says where it was cut); the exchange itself is never slowed by more than a copy of what is kept.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_rpc.spec import Protocol

from ..sessions.connection import Connection
from ..sessions.decode import decode_connection
from ..sessions.decoded import DecodedConnection
from ..sessions.pcapwrite import PcapWriter

#: Bytes of one check's exchange kept (both directions, all connections together).
BUDGET = 4 << 20


@dataclass
class RecordedConnection:
    """One connection of a check: what each side wrote, as (from_client, time, bytes) in order."""

    index: int
    client: tuple[str, int]
    server: tuple[str, int]
    start: float
    writes: list[tuple[bool, float, bytes]] = field(default_factory=list)
    #: Bytes not kept because the check's budget was spent (then the streams end early).
    dropped: int = 0
    closed: float | None = None

    def stream(self, from_client: bool) -> bytes:
        return b"".join(data for side, _t, data in self.writes if side == from_client)

    def capture(self) -> Connection:
        """This connection as the session decoder's :class:`~ggml_rpc.conformance.sessions.capture.Connection`
        (the kept bytes end early when the budget ran out: a cut, not a violation)."""
        return Connection.from_streams(self.index, self.client, self.server, self.start, self.stream(True),
                                       self.stream(False), cut=bool(self.dropped))


class Recorder:
    """The recorded connections of one check."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.connections: list[RecordedConnection] = []
        self._left = budget

    def wrap(self, sock: socket.socket) -> RecordingSocket:
        """``sock`` (just connected) as a socket that records what crosses it."""
        try:
            client, server = sock.getsockname()[:2], sock.getpeername()[:2]
        except OSError:
            client, server = ("127.0.0.1", 0), ("127.0.0.1", 0)
        conn = RecordedConnection(len(self.connections), (client[0], client[1]), (server[0], server[1]),
                                  time.time())
        self.connections.append(conn)
        return RecordingSocket(sock, conn, self)

    def keep(self, conn: RecordedConnection, from_client: bool, data: bytes | bytearray | memoryview) -> None:
        n = memoryview(data).nbytes
        if not n:
            return
        if conn.dropped or n > self._left:
            conn.dropped += n
            return
        self._left -= n
        conn.writes.append((from_client, time.time(), bytes(data)))

    @property
    def empty(self) -> bool:
        return not any(c.writes for c in self.connections)

    def write_pcap(self, path: str | Path) -> Path:
        """Every recorded connection as one TCP flow of a pcap, writes in the order they happened."""
        path = Path(path)
        start = min((c.start for c in self.connections), default=time.time())
        with PcapWriter(path, start=start) as writer:
            flows = {}
            for conn in self.connections:
                flows[conn.index] = writer.flow(conn.client, conn.server)
            events = sorted(((c.start, 0, c.index, None, b"") for c in self.connections),
                            key=lambda e: (e[0], e[1]))
            writes = [(t, 1, c.index, side, data) for c in self.connections for side, t, data in c.writes]
            closes = [(c.closed or (c.writes[-1][1] if c.writes else c.start), 2, c.index, None, b"")
                      for c in self.connections]
            for t, kind, index, side, data in sorted([*events, *writes, *closes], key=lambda e: (e[0], e[1])):
                flow = flows[index]
                if kind == 0:
                    flow.open(t)
                elif kind == 1:
                    flow.write(bool(side), data, t)
                else:
                    flow.close(t)
        return path

    def decoded(self, protocol: Protocol | None) -> Iterator[tuple[RecordedConnection, DecodedConnection]]:
        """Each connection with its spec decoding (requests, replies, the first error)."""
        for conn in self.connections:
            yield conn, decode_connection(conn.capture(), protocol)


class RecordingSocket:
    """A connected socket that hands a copy of every byte sent or received to its :class:`Recorder`."""

    def __init__(self, sock: socket.socket, conn: RecordedConnection, recorder: Recorder) -> None:
        self._sock = sock
        self._conn = conn
        self._recorder = recorder

    def sendall(self, data: Any, *flags: int) -> None:
        self._sock.sendall(data, *flags)
        self._recorder.keep(self._conn, True, data)

    def send(self, data: Any, *flags: int) -> int:
        n = self._sock.send(data, *flags)
        self._recorder.keep(self._conn, True, memoryview(data).cast("B")[:n])
        return n

    def sendmsg(self, buffers: Sequence[Any], *args: Any) -> int:
        n = self._sock.sendmsg(buffers, *args)
        left = n
        for b in buffers:
            view = memoryview(b).cast("B")
            if left <= 0:
                break
            self._recorder.keep(self._conn, True, view[:left])
            left -= view.nbytes
        return n

    def recv(self, n: int, *flags: int) -> bytes:
        data = self._sock.recv(n, *flags)
        self._recorder.keep(self._conn, False, data)
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, *flags: int) -> int:
        got = self._sock.recv_into(buffer, nbytes, *flags)
        self._recorder.keep(self._conn, False, memoryview(buffer).cast("B")[:got])
        return got

    def close(self) -> None:
        if self._conn.closed is None:
            self._conn.closed = time.time()
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
