"""lint and ``proxy --check`` are one checker fed two ways: on the same bytes they report the same violations.

Live, the proxy feeds chunks as they arrive; offline, lint feeds a capture's two streams.  Both are checked here on
sessions that break several rules (recorded through the proxy) and on every fixture of the kit, fed live in the
order a synchronous client produces and in the order a pipelining one does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ggml_rpc.conformance.sessions.capture import read_connections
from ggml_rpc.conformance.sessions.decode import decode_connection
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.peer_link import decode_with_links
from ggml_rpc.conformance.sessions.proxy import running_proxy
from ggml_rpc.conformance.sessions.scenarios import Session, bad_input, cache_flag_abuse
from ggml_rpc.conformance.sessions.stream_checker import StreamChecker, Violation
from ggml_rpc.reference import running_server
from ggml_rpc.spec import REPLY_HEADER_SIZE, REQUEST_HEADER_SIZE, V7, Command, encode_request, make_tensor
from ggml_rpc.spec.rules import BY_ID

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PCAPS = sorted(FIXTURES.glob("*.pcap")) + sorted(FIXTURES.glob("*/*.pcap"))


def _key(violations: list[Violation]) -> list[tuple[int, int | None, str, str]]:
    return sorted((v.connection, v.index if v.index is not None else -1, v.direction, v.rule) for v in violations)


def _more_breakers(s: Session) -> None:
    """Rules the scenarios leave alone: a region past its tensor, rows of size 0 (8.0.0 only, so not here), and a
    request cut short by the client closing (judged by the length it claimed)."""
    with s.connect() as c:
        t = make_tensor(id=1, ne=(4,), buffer=0, data=0, name="small")
        c.send_raw(encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 8, "size": 16}))
        c.expect_closed(2.0)
    with s.connect() as c:
        wire = encode_request(V7, Command.SET_TENSOR, {"tensor": make_tensor(id=2, ne=(4,), buffer=0, data=0),
                                                       "offset": 0, "cache_flag": 0}, bytes(64))
        c.send_raw(wire[:-32])  # the client leaves half-way through the data


def test_proxy_reports_what_lint_reports_on_its_own_recording(tmp_path):
    pcap = tmp_path / "broken.pcap"
    seen: list[Violation] = []
    with running_server("7", cache_dir=str(tmp_path / "cache")) as srv, \
            running_proxy(srv.address, pcap=pcap, check=True, on_violation=seen.append) as px:
        session = Session(px.host, px.port, srv.protocol)
        cache_flag_abuse(session)
        bad_input(session)
        _more_breakers(session)
    offline = lint_file(pcap)
    assert _key(seen) == _key(offline)
    assert {v.rule for v in offline} >= {"CACHE-FLAG-NO-MISS", "CACHE-FLAG-HASH", "CACHE-FLAG-MISSING", "DECODE",
                                         "TENSOR-TYPE", "GRAPH-NODE-UNKNOWN", "REGION-PAST-TENSOR"}
    assert all(v.rule in BY_ID for v in offline)


class _LiveFeed:
    """One connection's two streams, handed to a checker through its live entry points in pieces."""

    def __init__(self, checker: StreamChecker, c2s: bytes, s2c: bytes, chunk: int) -> None:
        self.checker, self.chunk = checker, chunk
        self.data = {True: memoryview(c2s), False: memoryview(s2c)}
        self.sent = {True: 0, False: 0}

    def upto(self, from_client: bool, end: int) -> None:
        data = self.data[from_client]
        end = min(end, len(data))
        while self.sent[from_client] < end:
            stop = min(self.sent[from_client] + self.chunk, end)
            piece = data[self.sent[from_client] : stop]
            (self.checker.client_bytes if from_client else self.checker.server_bytes)(piece)
            self.sent[from_client] = stop


def _feed_live(path: Path, *, pipelined: bool, chunk: int = 4096) -> list[Violation]:
    """Each connection through the live entry points (client_bytes/server_bytes, in pieces of ``chunk``).

    Synchronous: each reply follows its request, as a client that waits produces.  Pipelined: after the HELLO
    reply the client sends everything, then the server's bytes come."""
    out: list[Violation] = []
    conns = read_connections(path)
    # The servers' own link (8.0.0 tensor split) goes from server to server: no proxy in front of a client sees it.
    links = {c.conn.index for c in decode_with_links(conns, lambda c: decode_connection(c, validate=False))
             if c.link is not None}
    for conn in conns:
        if not conn.saw_syn or conn.index in links:
            continue
        dc = decode_connection(conn, validate=False)
        checker = StreamChecker(conn.index, out.append)
        feed = _LiveFeed(checker, bytes(conn.c2s.data), bytes(conn.s2c.data), chunk)
        replies = {id(r.request): r for r in dc.replies}
        for req in dc.requests:
            feed.upto(True, req.offset + REQUEST_HEADER_SIZE + req.size)
            rep = replies.get(id(req))
            if rep is not None and (not pipelined or req.command is Command.HELLO):
                feed.upto(False, rep.offset + REPLY_HEADER_SIZE + rep.size)
        feed.upto(True, len(conn.c2s.data))
        feed.upto(False, len(conn.s2c.data))
        checker.close()
    return out


@pytest.mark.parametrize("path", PCAPS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixtures_give_the_same_violations_live_and_offline(path):
    offline = [v for v in lint_file(path) if v.rule != "LINK-BYTES"]
    assert _key(_feed_live(path, pipelined=False)) == _key(offline)
    assert _key(_feed_live(path, pipelined=True, chunk=1000)) == _key(offline)


def test_a_hash_miss_is_judged_the_same_when_the_client_does_not_wait(tmp_path):
    """A client that sends SET_TENSOR before the SET_TENSOR_HASH reply arrived: the flag is judged by that reply."""
    from .conftest import hash_then_set, hello

    data = bytes(range(1, 256)) * 8
    writes = hello(V7) + hash_then_set(V7, data, flag=1)
    seen: list[Violation] = []
    checker = StreamChecker(0, seen.append)
    order = [0, 1, 2, 4, 3]  # HELLO, its reply, the hash, the SET_TENSOR, then the hash's reply
    for i in order:
        from_client, wire = writes[i]
        (checker.client_bytes if from_client else checker.server_bytes)(memoryview(wire))
    checker.close()
    assert seen == []
