"""Round trips of every request and reply of every version: construct against itself, and the codec against construct.

Values come from the strategies derived from the schemas (``ggml_rpc.spec.strategies``), so a command added to a
table is covered here without editing this file.
"""

from __future__ import annotations

import pytest
from codec_helpers import chunk_sizes, chunks, codec_plain, construct_build, construct_parse
from ggml_rpc.spec import (
    PROTOCOLS,
    REQUEST_HEADER_SIZE,
    Command,
    Payload,
    ReplyDecoder,
    RequestDecoder,
    Shape,
    encode_reply,
    encode_request,
)
from ggml_rpc.spec.codec import decode_payload
from ggml_rpc.spec.strategies import exchanges, requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REQUEST_CASES = [(p, c) for p in PROTOCOLS for c in p.commands]
REPLY_CASES = [(p, c) for p in PROTOCOLS for c, s in p.commands.items() if s.has_reply]


def _ids(case) -> str:
    p, c = case
    return f"{p.label}-{c.name}"


def _decode_request(protocol, wire: bytes, sizes: list[int], command: Command):
    dec = RequestDecoder(protocol, validate=False, expect_hello=command is Command.HELLO)
    out = []
    for piece in chunks(wire, sizes):
        out += dec.feed(piece)
    dec.finish()
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("case", REQUEST_CASES, ids=_ids)
@SETTINGS
@given(data=st.data())
def test_request_round_trip(case, data):
    protocol, command = case
    payload: Payload = protocol.commands[command].request
    msg = data.draw(requests(protocol, command), label="request")

    # construct against itself: parse(build(x)) == x
    built = construct_build(payload, msg.fields, msg.data)
    fields, bulk = construct_parse(payload, built)
    assert fields == msg.fields
    assert (bulk or b"") == (msg.data or b"")

    # the codec encodes the same bytes construct builds, behind the 9-byte header
    wire = encode_request(protocol, command, msg.fields, msg.data)
    assert wire[0] == protocol.wire_id(command)
    assert int.from_bytes(wire[1:REQUEST_HEADER_SIZE], "little") == len(built)
    assert wire[REQUEST_HEADER_SIZE:] == built

    # and decodes them, fed in arbitrary chunks, to what construct parses
    req = _decode_request(protocol, wire, data.draw(chunk_sizes, label="chunks"), command)
    assert req.command is command
    assert codec_plain(req.fields) == fields
    assert bytes(req.data if req.data is not None else b"") == (bulk or b"")
    assert req.size == len(built) and req.offset == 0


@pytest.mark.parametrize("case", REPLY_CASES, ids=_ids)
@SETTINGS
@given(data=st.data())
def test_reply_round_trip(case, data):
    protocol, command = case
    payload = protocol.commands[command].reply
    assert isinstance(payload, Payload)
    request, reply = data.draw(exchanges(protocol, command), label="exchange")
    assert reply is not None

    built = construct_build(payload, reply.fields, reply.data)
    fields, bulk = construct_parse(payload, built)
    assert fields == reply.fields
    assert (bulk or b"") == (reply.data or b"")

    wire = encode_reply(protocol, command, reply.fields, reply.data)
    assert int.from_bytes(wire[:8], "little") == len(built)
    assert wire[8:] == built

    req = _decode_request(protocol, encode_request(protocol, command, request.fields, request.data), [1 << 20],
                          command)
    dec = ReplyDecoder(protocol)
    assert dec.expect(req) is True
    out = []
    for piece in chunks(wire, data.draw(chunk_sizes, label="chunks")):
        out += dec.feed(piece)
    dec.finish()
    assert len(out) == 1 and dec.awaiting == 0
    rep = out[0]
    assert rep.command is command and rep.request is req
    assert codec_plain(rep.fields) == fields
    assert bytes(rep.data or b"") == (bulk or b"")


def _random_payload_bytes(payload: Payload) -> st.SearchStrategy[bytes]:
    if payload.shape is Shape.FIXED:
        n = payload.schema.sizeof()
        return st.binary(min_size=n, max_size=n)
    if payload.shape is Shape.HEADER_DATA:
        n = payload.schema.sizeof()
        return st.binary(min_size=n, max_size=n + 40)
    return st.binary(max_size=64)


FIXED_LIKE = [
    (p, c, side)
    for p in PROTOCOLS
    for c, s in p.commands.items()
    for side, payload in (("request", s.request), ("reply", s.reply))
    if isinstance(payload, Payload) and payload.shape is not Shape.GRAPH
]


@pytest.mark.parametrize("case", FIXED_LIKE, ids=lambda c: f"{c[0].label}-{c[1].name}-{c[2]}")
@SETTINGS
@given(data=st.data())
def test_build_parse_of_arbitrary_bytes(case, data):
    """build(parse(b)) == b for any bytes of a valid length, and the codec's derived layout parses them alike."""
    protocol, command, side = case
    spec = protocol.commands[command]
    payload = spec.request if side == "request" else spec.reply
    raw = data.draw(_random_payload_bytes(payload), label="bytes")
    fields, bulk = construct_parse(payload, raw)
    assert construct_build(payload, fields, bulk) == raw
    got, got_bulk = decode_payload(payload, memoryview(raw), command=command.name)
    assert codec_plain(got) == fields
    assert bytes(got_bulk if got_bulk is not None else b"") == (bulk or b"")


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.label)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_graph_build_parse_build(protocol, data):
    payload = protocol.commands[Command.GRAPH_COMPUTE].request
    msg = data.draw(requests(protocol, Command.GRAPH_COMPUTE, max_count=3))
    raw = payload.schema.build(msg.fields)
    assert payload.schema.build(payload.schema.parse(raw)) == raw
    assert msg.fields["n_nodes"] == len(msg.fields["nodes"])
    assert msg.fields["n_tensors"] == len(msg.fields["tensors"])


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.label)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_session_streams_pair_replies_and_never_wait_for_no_reply(protocol, data):
    """A whole session, both directions cut in random chunks: every reply pairs with its request, in order."""
    hello = data.draw(exchanges(protocol, Command.HELLO))
    rest = data.draw(
        st.lists(exchanges(protocol, max_count=2, max_data=32), max_size=8).filter(
            lambda xs: all(r.command is not Command.HELLO for r, _ in xs)
        ),
        label="session",
    )
    session = [hello, *rest]
    c2s = b"".join(encode_request(protocol, r.command, r.fields, r.data) for r, _ in session)
    s2c = b"".join(encode_reply(protocol, a.command, a.fields, a.data) for _, a in session if a is not None)

    reqs = RequestDecoder(protocol, validate=False)
    got = []
    for piece in chunks(c2s, data.draw(chunk_sizes)):
        got += reqs.feed(piece)
    reqs.finish()
    assert [r.command for r in got] == [r.command for r, _ in session]

    reps = ReplyDecoder(protocol)
    waits = [reps.expect(r) for r in got]
    assert waits == [a is not None for _, a in session]
    answered = []
    for piece in chunks(s2c, data.draw(chunk_sizes)):
        answered += reps.feed(piece)
    reps.finish()
    assert reps.awaiting == 0
    with_reply = [r for r, w in zip(got, waits, strict=True) if w]
    assert [a.request for a in answered] == with_reply
    expected = [a for _, a in session if a is not None]
    for rep, want in zip(answered, expected, strict=True):
        assert bytes(rep.data or b"") == (want.data or b"")
        assert codec_plain(rep.fields) == want.fields
