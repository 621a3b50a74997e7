"""The servers' own link of 8.0.0 (tensor split), decoded from the client connections that set it up.

A COMM_INIT of rank 0 makes that server listen on ``port``; the rank-1 server connects there.  The link carries no
headers: first each side's 24 caps bytes (the connector's first), then, for every COMM_ALLREDUCE the client sends to
rank 0, each rank's copy of the tensor — F32 tensors of 32,768 elements or more as BF16 (half the bytes).  So the
link is read by the COMM_ALLREDUCE sequence of the rank-0 client connection: a capture holding that connection
decodes the link exchange by exchange, and a link whose bytes do not add up is reported as such.

A connection to the port that carries no byte either way is not the link but a connect dropped before it (genuine
8.0.0 peers make one: the rank-1 server's first connect, closed unused, then the one that carries the link); it is
decoded as such and breaks no rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ggml_rpc.spec import Command, Direction, ProtocolError, tensor_name, type_name
from ggml_rpc.spec.enums import TYPES
from ggml_rpc.spec.facts import CONN_CAPS_SIZE, comm_wire_type, tensor_nbytes

from .capture import Connection
from .decoded import DecodedConnection, LinkExchange, PeerLink


def _wire(tensor: dict[str, Any]) -> tuple[str, int]:
    """The type and byte count one rank's copy of ``tensor`` takes on the link (spec's rule)."""
    count = 1
    for n in tensor["ne"]:
        count *= int(n)
    wire = comm_wire_type(tensor["type"], count)
    if wire == tensor["type"]:
        return type_name(wire), tensor_nbytes(tensor)
    return type_name(wire), count * TYPES[wire].size


def link_ports(decoded: Sequence[DecodedConnection]) -> dict[int, tuple[DecodedConnection, int]]:
    """Port -> (rank-0 client connection, index of its COMM_INIT) for every COMM_INIT of rank 0 in a capture."""
    out: dict[int, tuple[DecodedConnection, int]] = {}
    for dc in decoded:
        for req in dc.requests:
            if req.command is Command.COMM_INIT and req.fields["rank"] == 0:
                out[req.fields["port"]] = (dc, req.index)
    return out


def decode_peer_link(conn: Connection, rank0: DecodedConnection, init_index: int, port: int) -> DecodedConnection:
    """A connection to a COMM_INIT port, decoded as the servers' link (``link`` set on the result)."""
    sizes = [conn.c2s.size, conn.s2c.size]  # lengths only: a link carries whole tensors, never read here
    link = PeerLink(port, (rank0.conn.index, init_index), unused=sizes == [0, 0])
    out = DecodedConnection(conn, rank0.protocol, notes=list(conn.notes), link=link)
    if link.unused:
        return out
    need = CONN_CAPS_SIZE
    for req in rank0.requests:
        if req.command is Command.COMM_ALLREDUCE and req.index > init_index:
            wire, n = _wire(req.fields["tensor"])
            if n == 0:
                continue
            link.exchanges.append(LinkExchange(len(link.exchanges), tensor_name(req.fields["tensor"]["name"]), wire,
                                               n, (rank0.conn.index, req.index)))
            need += n
        elif req.command is Command.COMM_FREE and req.index > init_index:
            break
    for direction, got in zip(Direction, sizes, strict=True):
        if got != need:
            out.error = ProtocolError(f"the link carries {got} bytes this way, but its caps and the "
                                      f"{len(link.exchanges)} COMM_ALLREDUCE of connection {rank0.conn.index} "
                                      f"make {need}")
            out.error_direction = direction
            break
    return out


def decode_with_links(conns: Sequence[Connection],
                      decode: Callable[[Connection], DecodedConnection]) -> list[DecodedConnection]:
    """Decode every connection with ``decode(conn)`` (the caller's options: a forced version, validation), then
    re-read the ones that go to a COMM_INIT port of rank 0 as the servers' link."""
    decoded = [decode(c) for c in conns]
    ports = link_ports(decoded)
    if not ports:
        return decoded
    for i, dc in enumerate(decoded):
        found = ports.get(dc.conn.server[1])
        if found is not None and found[0] is not dc and dc.conn.start >= found[0].conn.start:
            decoded[i] = decode_peer_link(dc.conn, found[0], found[1], dc.conn.server[1])
    return decoded


def describe_link(dc: DecodedConnection) -> list[str]:
    """One line for the link, then one per exchange."""
    link = dc.link
    assert link is not None
    if link.unused:
        return [f"connection to the servers' link port {link.port} (COMM_INIT #{link.init[1]} of connection "
                f"{link.init[0]}) that carried no bytes: a connect dropped before the link's"]
    lines = [f"servers' link (COMM) on port {link.port}, opened by COMM_INIT #{link.init[1]} of connection "
             f"{link.init[0]}: {CONN_CAPS_SIZE} caps bytes each way, then {len(link.exchanges)} exchange(s)"]
    lines += [f"COMM_ALLREDUCE {x.tensor} as {x.wire_type}: {x.nbytes} bytes each way (request #{x.request[1]})"
              for x in link.exchanges]
    return lines


__all__ = ["LinkExchange", "PeerLink", "decode_peer_link", "decode_with_links", "describe_link", "link_ports"]
