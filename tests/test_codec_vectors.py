"""Exact byte vectors of the framing, the message layouts, HELLO and the v6/v7 differences, assembled by hand."""

from __future__ import annotations

import struct

import pytest
from ggml_rpc.spec import (
    V6,
    V7,
    V7_0_1,
    Command,
    ReplyDecoder,
    RequestDecoder,
    encode_reply,
    encode_request,
    hello_reply,
    make_tensor,
    protocol_from_hello,
)

ZERO24 = bytes(24)


def test_hello_request_bytes():
    want = bytes.fromhex("0e 18 00 00 00 00 00 00 00") + ZERO24
    for p in (V6, V7, V7_0_1):
        assert encode_request(p, Command.HELLO, {"conn_caps": ZERO24}) == want


@pytest.mark.parametrize(
    ("protocol", "version_bytes"),
    [(V6, "06 00 00 00"), (V7, "07 00 00 00"), (V7_0_1, "07 00 01 00")],
    ids=["6.0.0", "7.0.0", "7.0.1"],
)
def test_hello_reply_bytes(protocol, version_bytes):
    want = bytes.fromhex("1c 00 00 00 00 00 00 00" + version_bytes) + ZERO24
    assert encode_reply(protocol, Command.HELLO, hello_reply(protocol.version)) == want
    # decoding that reply teaches an auto-detecting decoder the version
    req = RequestDecoder().feed(bytes.fromhex("0e 18 00 00 00 00 00 00 00") + ZERO24)[0]
    dec = ReplyDecoder()
    dec.expect(req)
    (rep,) = dec.feed(want)
    assert (rep.fields["major"], rep.fields["minor"], rep.fields["patch"]) == protocol.version
    assert dec.protocol is protocol and protocol_from_hello(rep.fields) is protocol


def test_device_count_exchange_bytes():
    assert encode_request(V7, Command.DEVICE_COUNT) == bytes.fromhex("0f 00 00 00 00 00 00 00 00")
    assert encode_reply(V7, Command.DEVICE_COUNT, {"device_count": 1}) == bytes.fromhex(
        "04 00 00 00 00 00 00 00 01 00 00 00"
    )


def _tensor_bytes() -> bytes:
    """An rpc_tensor written at the offsets of spec/PROTOCOL.md#rpc_tensor, independently of the schema."""
    raw = bytearray(296)
    struct.pack_into("<Q", raw, 0, 0x1122334455667788)  # id
    struct.pack_into("<I", raw, 8, 0)  # type F32
    struct.pack_into("<Q", raw, 12, 0xAABBCCDD00112233)  # buffer, unaligned
    struct.pack_into("<4I", raw, 20, 8, 2, 1, 1)  # ne
    struct.pack_into("<4I", raw, 36, 4, 32, 64, 64)  # nb
    struct.pack_into("<Q", raw, 220, 0x7F0000001000)  # data
    raw[228 : 228 + 4] = b"w.ok"  # name
    return bytes(raw)


TENSOR = make_tensor(id=0x1122334455667788, type=0, ne=(8, 2), buffer=0xAABBCCDD00112233, data=0x7F0000001000,
                     name="w.ok")
DATA = bytes(range(64))


def test_tensor_builder_matches_the_hand_made_bytes():
    assert encode_request(V6, Command.INIT_TENSOR, {"tensor": TENSOR})[9:] == _tensor_bytes()


def test_set_tensor_v6_layout():
    wire = encode_request(V6, Command.SET_TENSOR, {"tensor": TENSOR, "offset": 0x0102030405060708}, DATA)
    want = b"\x06" + struct.pack("<Q", 304 + 64) + _tensor_bytes() + struct.pack("<Q", 0x0102030405060708) + DATA
    assert wire == want
    payload = wire[9:]
    assert payload[296:304] == bytes.fromhex("08 07 06 05 04 03 02 01")  # offset at 296
    assert payload[304:] == DATA  # data at 304


def test_set_tensor_v7_layout():
    fields = {"tensor": TENSOR, "cache_flag": 1, "offset": 0x0102030405060708}
    wire = encode_request(V7, Command.SET_TENSOR, fields, DATA)
    want = b"\x06" + struct.pack("<Q", 305 + 64) + _tensor_bytes() + b"\x01" + struct.pack("<Q", 0x0102030405060708)
    assert wire == want + DATA
    payload = wire[9:]
    assert payload[296] == 1  # cache_flag at 296
    assert payload[297:305] == bytes.fromhex("08 07 06 05 04 03 02 01")  # offset at 297, unaligned
    assert payload[305:] == DATA  # data at 305
    assert encode_request(V7_0_1, Command.SET_TENSOR, fields, DATA) == wire


def test_crossed_set_tensor_layouts_misread_as_protocol_md_describes():
    """A v6 reader takes the cache_flag as the offset's low byte and shifts the rest into the data."""
    v7 = encode_request(V7, Command.SET_TENSOR, {"tensor": TENSOR, "cache_flag": 0, "offset": 0x10}, DATA)
    (as_v6,) = RequestDecoder(V6, validate=False, expect_hello=False).feed(v7)
    assert as_v6.fields["offset"] == 0x10 << 8  # flag byte 0, then offset bytes 10 00 .. 00 (7 of them)
    assert bytes(as_v6.data) == b"\x00" + DATA
    v6 = encode_request(V6, Command.SET_TENSOR, {"tensor": TENSOR, "offset": 0x10}, DATA)
    (as_v7,) = RequestDecoder(V7, validate=False, expect_hello=False).feed(v6)
    assert as_v7.fields["cache_flag"] == 0x10  # the offset's low byte turns caching on
    assert as_v7.fields["offset"] == 0  # the remaining 7 offset bytes and the first data byte
    assert bytes(as_v7.data) == DATA[1:]


def test_graph_compute_layout():
    tensors = [make_tensor(id=7, ne=(4,)), make_tensor(id=9, ne=(4,), src=[7])]
    wire = encode_request(V7, Command.GRAPH_COMPUTE,
                          {"device": 3, "n_nodes": 1, "nodes": [9], "n_tensors": 2, "tensors": tensors})
    payload = wire[9:]
    assert len(payload) == 12 + 8 * 1 + 296 * 2
    assert struct.unpack_from("<IIQI", payload, 0) == (3, 1, 9, 2)
    assert struct.unpack_from("<Q", payload, 20)[0] == 7  # first tensor at 12 + 8·n_nodes
    assert struct.unpack_from("<Q", payload, 20 + 296 + 124)[0] == 7  # second tensor's src[0]


def test_fixed_request_sizes_from_the_fact_sheet():
    sizes = {
        Command.ALLOC_BUFFER: 12, Command.GET_ALIGNMENT: 4, Command.GET_MAX_SIZE: 4, Command.BUFFER_GET_BASE: 8,
        Command.FREE_BUFFER: 8, Command.BUFFER_CLEAR: 9, Command.SET_TENSOR_HASH: 312, Command.GET_TENSOR: 312,
        Command.COPY_TENSOR: 592, Command.GET_DEVICE_MEMORY: 4, Command.INIT_TENSOR: 296,
        Command.GET_ALLOC_SIZE: 3260, Command.HELLO: 24, Command.DEVICE_COUNT: 0, Command.GRAPH_RECOMPUTE: 4,
        Command.MEMSET_TENSOR: 313,
    }
    for cmd, n in sizes.items():
        assert V7.commands[cmd].request.header_size == n, cmd.name
    assert V7_0_1.commands[Command.GET_DEVICE_SUPPORTS_OP].request.header_size == 3260
    replies = {
        Command.ALLOC_BUFFER: 16, Command.GET_ALIGNMENT: 8, Command.GET_MAX_SIZE: 8, Command.BUFFER_GET_BASE: 8,
        Command.SET_TENSOR_HASH: 1, Command.COPY_TENSOR: 1, Command.GET_DEVICE_MEMORY: 16,
        Command.GET_ALLOC_SIZE: 8, Command.HELLO: 28, Command.DEVICE_COUNT: 4,
    }
    for p in (V6, V7):
        with_reply = {c for c, s in p.commands.items() if s.has_reply}
        assert with_reply == set(replies) | {Command.GET_TENSOR}
        for cmd, n in replies.items():
            assert p.commands[cmd].reply.header_size == n, cmd.name
