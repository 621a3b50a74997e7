"""The captures a replay sends, decoded and checked before anything is sent (:mod:`.replay` replays them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ggml_rpc.spec import Command, Direction, Protocol, fnv1a64

from .decode import DecodedConnection, decode_file
from .spans import LazyBytes


class ReplayError(Exception):
    """The captures cannot be replayed at all (undecodable, mixed versions without ``--as``...)."""


@dataclass
class LoadedCapture:
    path: str
    connections: list[DecodedConnection]


def load_captures(paths: Sequence[str | Path], protocol: Protocol | None = None) -> list[LoadedCapture]:
    """Decode every capture; any connection that does not decode cleanly makes the replay impossible."""
    out = []
    for path in paths:
        conns = decode_file(path, protocol, validate=False)
        for dc in conns:
            # A client stream that breaks the spec is replayed as recorded up to the break, then sent raw: the
            # recorded server closed there, the target must too.  A broken server stream cannot be replayed.
            if dc.error is not None and dc.error_direction is not Direction.C2S:
                raise ReplayError(f"{path}: connection {dc.conn.index}: the recorded server's replies do not decode "
                                  f"({dc.error}); run `ggml-rpc decode` for details")
            if dc.protocol is None and dc.error is None and not dc.cuts:
                raise ReplayError(f"{path}: connection {dc.conn.index}: protocol version unknown (no HELLO reply)")
        out.append(LoadedCapture(str(path), conns))
    return out


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
