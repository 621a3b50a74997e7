"""Decoding a whole connection: replies sent before a client-side violation are still decoded."""

from __future__ import annotations

import struct

from ggml_rpc.conformance.sessions.connection import Connection
from ggml_rpc.conformance.sessions.decode import decode_connection
from ggml_rpc.spec import V7, Command, SizeMismatch, encode_reply, encode_request, hello_reply


def _connection(c2s: bytes, s2c: bytes) -> Connection:
    return Connection.from_streams(0, ("127.0.0.1", 40000), ("127.0.0.1", 50052), 0.0, c2s, s2c)


def test_replies_before_a_client_violation_are_decoded():
    c2s = (
        encode_request(V7, Command.HELLO, {"conn_caps": bytes(24)})
        + encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})
        + struct.pack("<BQ", Command.GET_ALIGNMENT, 5)  # wrong fixed size: the server closes here
        + bytes(5)
    )
    s2c = encode_reply(V7, Command.HELLO, hello_reply(V7.version)) + encode_reply(
        V7, Command.GET_ALIGNMENT, {"alignment": 32}
    )
    dc = decode_connection(_connection(c2s, s2c))
    assert isinstance(dc.error, SizeMismatch)
    assert dc.error_direction == "client->server"
    assert dc.error.command == "GET_ALIGNMENT" and dc.error.field == "size"
    assert [r.command for r in dc.requests] == [Command.HELLO, Command.GET_ALIGNMENT]
    assert [r.fields for r in dc.replies][1] == {"alignment": 32}
    assert [r.request for r in dc.replies] == dc.requests


def test_a_server_violation_after_a_client_violation_is_kept_as_a_note():
    c2s = encode_request(V7, Command.HELLO, {"conn_caps": bytes(24)}) + struct.pack("<BQ", 200, 0)
    s2c = encode_reply(V7, Command.HELLO, hello_reply(V7.version)) + struct.pack("<Q", 1) + b"\x00"
    dc = decode_connection(_connection(c2s, s2c))
    assert dc.error is not None and dc.error_direction == "client->server"
    assert any("server->client stream also breaks the spec" in n for n in dc.notes)
