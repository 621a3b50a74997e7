"""A client that leaves before reading its reply, as a reproducer records it and ``ggml-rpc replay`` re-runs it.

The pcap carries the client's FIN right after its last request and the server's reply after that FIN (then the
client host's reset); the capture reader keeps where the FIN came, and replay sends the requests and closes
without reading, as many connections as the file holds.
"""

from __future__ import annotations

import socket
import threading

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.fuzz.oracle import ModelConnection
from ggml_rpc.conformance.fuzz.targets import fuzz_config
from ggml_rpc.conformance.sessions.capture import read_connections
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.replay import left_before_reply, replay
from ggml_rpc.reference import running_server
from ggml_rpc.spec import CONN_CAPS_SIZE, V7, Command, encode_request

HELLO = encode_request(V7, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
ALIGN = encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})


def _exchange() -> list[tuple[bool, bytes]]:
    """HELLO and GET_ALIGNMENT as the reference answers them."""
    m = ModelConnection(fuzz_config(V7), None)
    try:
        return [(True, HELLO), (False, m.exchange(HELLO).reply), (True, ALIGN), (False, m.exchange(ALIGN).reply)]
    finally:
        m.close()


def test_an_early_connection_carries_the_fin_before_the_reply(tmp_path):
    writes = _exchange()
    path = tmp_path / "early.pcap"
    write_session(path, [writes, writes], early=[0])
    early, normal = read_connections(path)
    hello_reply = len(writes[1][1])
    # The FIN came when only the HELLO reply had been sent; the GET_ALIGNMENT reply followed it.
    assert early.c2s.fin_peer_bytes == hello_reply < len(early.s2c.data) == hello_reply + len(writes[3][1])
    assert normal.c2s.fin_peer_bytes == len(normal.s2c.data)
    first, second = decode_file(path)
    assert left_before_reply(first) == hello_reply
    assert left_before_reply(second) is None
    # Both still decode to the same messages: the reply written into the closed socket is part of the record.
    assert [r.command for r in first.replies] == [r.command for r in second.replies]


def test_replay_leaves_where_the_client_did_and_the_reference_lives_on(tmp_path):
    writes = _exchange()
    path = tmp_path / "early.pcap"
    write_session(path, [writes] * 3 + [writes[:2]], early=range(3))
    with running_server("7") as srv:
        report = replay([path], srv.host, srv.port, timeout=10)
        assert report.ok, [m.line() for m in report.mismatches]
        assert report.connections == 4
        assert sum("left before reading the reply to message 1 (GET_ALIGNMENT)" in n for n in report.notes) == 3
        with RpcClient.connect(srv.host, srv.port, timeout=5) as c:
            assert c.device_count() >= 1


def test_replay_does_not_read_the_reply_it_left_before(tmp_path):
    """Against a bare listener: the replayer sends HELLO, reads its reply, sends GET_ALIGNMENT and closes; the
    listener answers the HELLO only, and sees the close without being asked for anything more."""
    writes = _exchange()
    path = tmp_path / "early.pcap"
    write_session(path, [writes], early=[0])
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            buf = b""
            while len(buf) < len(HELLO):
                buf += conn.recv(4096)
            conn.sendall(writes[1][1])
            while chunk := conn.recv(4096):
                buf += chunk
            got.append(buf)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # A one-connection listener, not a server: it is not asked for a HELLO afterwards.
        report = replay([path], "127.0.0.1", listener.getsockname()[1], timeout=10, check_alive=False)
    finally:
        thread.join(10)
        listener.close()
    assert report.ok, [m.line() for m in report.mismatches]
    assert got == [HELLO + ALIGN]  # everything the client sent, then its close (no reply was ever waited for)


def test_a_connection_whose_hello_got_no_reply_is_replayed(tmp_path):
    """A check's capture after a death: the session that killed the server, then the kit's probe, a HELLO the dead
    server never answered.  The replay must not refuse the file (the security table's verification replays such
    captures); against a live server it sends the probe's HELLO and reports that it was answered."""
    writes = _exchange()
    path = tmp_path / "probe.pcap"
    write_session(path, [writes, [(True, HELLO)]])
    first, probe = decode_file(path)
    assert first.protocol is not None and probe.protocol is None
    assert [r.command for r in probe.requests] == [Command.HELLO]
    with running_server("7") as srv:
        report = replay([path], srv.host, srv.port, timeout=10)
    assert report.connections == 2
    # The recorded server said nothing to the probe; the reference answers it.
    assert [(m.connection, m.command) for m in report.mismatches] == [(1, "HELLO")], report.mismatches
    assert "expected the server to close the connection" in report.mismatches[0].line()
