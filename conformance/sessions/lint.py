"""Rule checks on a captured session (``ggml-rpc lint``): the proxy's live checker, fed from a capture.

Each connection's two streams go through :class:`~.stream_checker.StreamChecker` -- the checker ``proxy --check``
runs live -- so lint reports exactly what the proxy reports on the same bytes.  The rules and their ids are the
table's (:data:`ggml_rpc.spec.rules.RULES`).  One thing only a capture can tell: which connection is an 8.0.0
servers' link (it goes to the port a COMM_INIT of rank 0 named); such a connection carries no messages and is
checked by :mod:`.peer_link` instead (``LINK-BYTES``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ggml_rpc.spec import Direction, Protocol, ProtocolError
from ggml_rpc.spec.rules import RULES as TABLE
from ggml_rpc.spec.rules import follows_miss, other_framing, shifted_framing

from .capture import Connection, HalfConnection, read_connections
from .decode import decode_connection
from .peer_link import decode_peer_link
from .stream_checker import StreamChecker, Violation
from .truncation import CAPTURE_TRUNCATED, RULE_TEXT

#: Rule id -> one-line text, from the table (the ids lint and the proxy report), and lint's own id for a capture
#: that ends inside a message (only a recording can be cut short; the proxy sees the live stream).
RULES = {r.id: r.text for r in TABLE} | {CAPTURE_TRUNCATED: RULE_TEXT}


def check_connection(conn: Connection, protocol: Protocol | None = None) -> tuple[list[Violation], StreamChecker]:
    """Every violation of one captured connection, and the checker that found them."""
    out: list[Violation] = []
    checker = StreamChecker(conn.index, out.append, protocol=protocol, expect_hello=conn.saw_syn)
    if not conn.saw_syn and protocol is None:
        out.append(Violation("DECODE", conn.index, 0, Direction.C2S, None,
                             "capture starts mid-connection and no --proto was given: version unknown"))
        return out, checker
    # Read a window at a time: bounded memory.
    checker.run(conn.c2s.chunks(), conn.s2c.chunks(), client_cut=_cut_at(conn.c2s), server_cut=_cut_at(conn.s2c))
    return out, checker


def _cut_at(d: HalfConnection) -> int | None:
    """Where the capture stopped a direction it cut (a hole from lost packets is not a cut: framing stops there, as
    it always has)."""
    return d.size if d.cut and d.gap_at is None else None


def _link_violations(conn: Connection, rank0: Connection, init_index: int, protocol: Protocol | None
                     ) -> list[Violation]:
    """A servers' link, checked against the COMM_ALLREDUCE sequence of the rank-0 client connection."""
    dc = decode_peer_link(conn, decode_connection(rank0, protocol, validate=False), init_index, conn.server[1])
    if dc.error is None:
        return []
    return [Violation("LINK-BYTES", conn.index, None, dc.error_direction or Direction.C2S, None, str(dc.error))]


def lint_connections(conns: Iterable[Connection], protocol: Protocol | None = None) -> list[Violation]:
    """Every violation in these connections of a capture, connection by connection."""
    conns = list(conns)
    found: dict[int, list[Violation]] = {}
    ports: dict[int, tuple[Connection, int]] = {}
    for conn in conns:
        found[conn.index], checker = check_connection(conn, protocol)
        for index, port in checker.comm_inits:
            ports[port] = (conn, index)
    out: list[Violation] = []
    for conn in conns:
        link = ports.get(conn.server[1])
        if link is not None and link[0] is not conn and conn.start >= link[0].start:
            out.extend(_link_violations(conn, link[0], link[1], protocol))
        else:
            out.extend(found[conn.index])
    return out


def lint_file(path: str | Path, protocol: Protocol | None = None, *, port: int | None = None) -> list[Violation]:
    """Every violation in a capture, connection by connection."""
    return lint_connections(read_connections(path, port=port), protocol)


def summarize(violations: Iterable[Violation]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.rule] = counts.get(v.rule, 0) + 1
    return counts


__all__ = ["RULES", "ProtocolError", "Violation", "check_connection", "follows_miss", "lint_connections",
           "lint_file", "other_framing", "shifted_framing", "summarize"]
