"""The captures a replay sends, decoded and checked before anything is sent (:mod:`.replay` replays them)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ggml_rpc.spec import Command, Direction, Protocol, fnv1a64

from .connection import Connection
from .decode import DecodedConnection, decode_connection, decode_file
from .pcapwrite import Write
from .peer_link import decode_with_links
from .spans import LazyBytes


class ReplayError(Exception):
    """The captures cannot be replayed at all (undecodable, mixed versions without ``--as``...)."""


@dataclass
class LoadedCapture:
    path: str
    connections: list[DecodedConnection]


def load_captures(paths: Sequence[str | Path], protocol: Protocol | None = None) -> list[LoadedCapture]:
    """Decode every capture; any connection that does not decode cleanly makes the replay impossible."""
    return [_checked(str(path), decode_file(path, protocol, validate=False)) for path in paths]


def capture_of_writes(connections: Iterable[Sequence[Write]], *, early: Collection[int] = (),
                      name: str = "(in memory)") -> LoadedCapture:
    """The capture :func:`.pcapwrite.write_session` would write for ``connections`` (each connection's writes, in
    order), decoded as :func:`load_captures` decodes that file, without writing or reading it: each connection's
    two streams, closed by both sides, or (``early``) left by the client before the server's last writes."""
    conns = []
    for number, writes in enumerate(connections):
        last = max((i for i, (from_client, _) in enumerate(writes) if from_client), default=-1)
        c2s = b"".join(bytes(data) for from_client, data in writes if from_client)
        s2c = b"".join(bytes(data) for from_client, data in writes if not from_client)
        conn = Connection.from_streams(number, ("127.0.0.1", 40000 + number), ("127.0.0.1", 50052), 0.0, c2s, s2c)
        conn.c2s.seen, conn.s2c.seen = len(c2s), len(s2c)
        conn.c2s.fin = True
        if number in early:
            # The client's FIN after its last request; what the server wrote after it is answered with a reset.
            conn.c2s.fin_peer_bytes = sum(len(data) for from_client, data in writes[:last + 1] if not from_client)
            conn.c2s.rst = conn.c2s.fin_peer_bytes < len(s2c)
        else:
            conn.c2s.fin_peer_bytes = len(s2c)
            conn.s2c.fin, conn.s2c.fin_peer_bytes = True, len(c2s)
        conns.append(conn)
    return _checked(name, decode_with_links(conns, lambda c: decode_connection(c, None, validate=False)))


def _checked(path: str, conns: list[DecodedConnection]) -> LoadedCapture:
    for dc in conns:
        # A client stream that breaks the spec is replayed as recorded up to the break, then sent raw: the
        # recorded server closed there, the target must too.  A broken server stream cannot be replayed.
        if dc.error is not None and dc.error_direction is not Direction.C2S:
            raise ReplayError(f"{path}: connection {dc.conn.index}: the recorded server's replies do not decode "
                              f"({dc.error}); run `ggml-rpc decode` for details")
        # A connection whose only request is an unanswered HELLO (the recorded server was dead, or died, when it
        # came: a check's liveness probe after a death) needs no version: it is sent as the version the others
        # speak, and the recorded server's silence is what the target is held to.
        if dc.protocol is None and dc.error is None and not dc.cuts and \
                any(req.command is not Command.HELLO for req in dc.requests):
            raise ReplayError(f"{path}: connection {dc.conn.index}: protocol version unknown (no HELLO reply)")
    return LoadedCapture(path, conns)


def source_protocol(captures: Sequence[LoadedCapture], default: Protocol | None = None) -> Protocol:
    """The one version the captures speak (ReplayError if they mix versions); ``default`` when no connection got
    as far as a HELLO reply."""
    versions = {dc.protocol.label: dc.protocol for cap in captures for dc in cap.connections
                if dc.protocol is not None}
    if not versions:
        if default is not None:
            return default
        raise ReplayError("no connection of the captures names its version (no HELLO reply): give --proto or --as")
    if len(versions) > 1:
        raise ReplayError(f"the captures mix protocol versions ({', '.join(sorted(versions))}): replay them "
                          "separately")
    return next(iter(versions.values()))


def cut_at(dc: DecodedConnection) -> int | None:
    """Index of the first request the capture does not hold whole with its reply (None: the capture is whole)."""
    return min((cut.index for cut in dc.cuts), default=None)


def left_before_reply(dc: DecodedConnection) -> int | None:
    """Where in the server's stream the recorded client stopped reading (its FIN came before the server had sent
    everything the capture holds), or None for a client that read all it was sent."""
    c2s, s2c = dc.conn.c2s, dc.conn.s2c
    if c2s.fin_peer_bytes is not None and c2s.fin_peer_bytes < s2c.size:
        return c2s.fin_peer_bytes
    return None


class Payloads:
    """The SET_TENSOR payloads of the loaded captures by hash: what a replay sends when a capture hits a cache
    entry the target cannot hold."""

    def __init__(self, captures: Sequence[LoadedCapture]) -> None:
        self.captures = captures
        self._by_hash: dict[int, memoryview | LazyBytes] | None = None

    def _all(self) -> Iterator[memoryview | LazyBytes]:
        for cap in self.captures:
            for dc in cap.connections:
                for req in dc.requests:
                    if req.command is Command.SET_TENSOR and req.data is not None and req.data.nbytes:
                        yield req.data

    def data_for(self, digest: int) -> memoryview | LazyBytes | None:
        """A payload with this hash (all are hashed once, when first needed: only replays that need a cache state
        the target lacks pay for it)."""
        if self._by_hash is None:
            self._by_hash = {}
            for data in self._all():
                self._by_hash.setdefault(fnv1a64(data), data)
        return self._by_hash.get(digest)
