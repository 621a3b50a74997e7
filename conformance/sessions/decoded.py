"""A capture's connection, decoded: its requests and replies (:mod:`.decode`), or, for the servers' own link of
8.0.0, the exchanges it carried (:mod:`.peer_link`).

The record both decoders fill, below either of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ggml_rpc.spec import Direction, Protocol, ProtocolError, Reply, Request

from .capture import Connection
from .truncation import CaptureCut


@dataclass(frozen=True)
class LinkExchange:
    """One COMM_ALLREDUCE as the link carries it: both ranks' copies of one tensor."""

    index: int
    tensor: str
    wire_type: str
    nbytes: int
    #: Where the client asked for it: (connection, request index) of the rank-0 COMM_ALLREDUCE.
    request: tuple[int, int]


@dataclass
class PeerLink:
    """A decoded servers' link: which COMM_INIT opened it and every exchange it carried."""

    port: int
    init: tuple[int, int]
    exchanges: list[LinkExchange] = field(default_factory=list)
    #: The connection carried no byte either way: a connect to the port dropped before the one that is the link.
    unused: bool = False


@dataclass
class DecodedConnection:
    """One connection of a capture, decoded."""

    conn: Connection
    protocol: Protocol | None
    requests: list[Request] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    #: The spec violation that stopped decoding, with the direction it was found in.
    error: ProtocolError | None = None
    error_direction: Direction | None = None
    #: Version announced by the server even when the kit does not cover it.
    announced: tuple[int, int, int] | None = None
    notes: list[str] = field(default_factory=list)
    #: 8.0.0: set when the connection is the servers' own link (:mod:`.peer_link`), which has no messages.
    link: PeerLink | None = None
    #: Where the capture ends inside a message of this connection (a damaged or stopped capture), per direction.
    cuts: list[CaptureCut] = field(default_factory=list)

    def messages(self) -> Iterator[Request | Reply]:
        """Requests in order, each followed by its reply (if any)."""
        by_req = {id(r.request): r for r in self.replies}
        for req in self.requests:
            yield req
            rep = by_req.get(id(req))
            if rep is not None:
                yield rep

    @property
    def ok(self) -> bool:
        return self.error is None


__all__ = ["DecodedConnection", "LinkExchange", "PeerLink"]
