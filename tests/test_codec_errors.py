"""Decoder errors: typed, naming the command, the field and the byte offset; never a crash or a big allocation."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from ggml_rpc.spec import (
    V6,
    V7,
    V7_0_1,
    Command,
    HandshakeError,
    ProtocolError,
    ReplyDecoder,
    RequestDecoder,
    SizeLimitExceeded,
    SizeMismatch,
    SpecViolation,
    Truncated,
    UnexpectedReply,
    UnknownCommand,
    encode_reply,
    encode_request,
    hello_reply,
    make_tensor,
)

HELLO = encode_request(V7, Command.HELLO, {"conn_caps": bytes(24)})  # 33 bytes
HELLO_LEN = len(HELLO)


def header(cmd: int, size: int) -> bytes:
    return struct.pack("<BQ", cmd, size)


def after_hello(protocol=V7, **kw) -> RequestDecoder:
    dec = RequestDecoder(protocol, **kw)
    assert [r.command for r in dec.feed(HELLO)] == [Command.HELLO]
    return dec


def assert_names(err: ProtocolError, command: str | None, field: str | None, offset: int) -> None:
    assert (err.command, err.field, err.offset) == (command, field, offset)
    text = str(err)
    if command:
        assert command in text
    if field:
        assert repr(field) in text
    assert f"at byte {offset}" in text


def test_unknown_command_id():
    dec = after_hello()
    with pytest.raises(UnknownCommand) as exc:
        dec.feed(header(200, 0))
    assert_names(exc.value, "CMD_200", "cmd", HELLO_LEN)


def test_none_is_never_on_the_wire():
    for protocol in (V6, V7, V7_0_1):
        dec = after_hello(protocol)
        with pytest.raises(UnknownCommand) as exc:
            dec.feed(header(Command.NONE, 0))
        assert_names(exc.value, "NONE", "cmd", HELLO_LEN)
        assert "never sent" in exc.value.message


def test_command_of_a_later_version():
    req = encode_request(V7_0_1, Command.GET_DEVICE_SUPPORTS_OP,
                         {"device": 0, "op": make_tensor(id=1), "srcs": [make_tensor(id=0)] * 10})
    assert [r.command for r in after_hello(V7_0_1).feed(req)] == [Command.GET_DEVICE_SUPPORTS_OP]
    with pytest.raises(UnknownCommand) as exc:
        after_hello(V7).feed(req)
    assert_names(exc.value, "GET_DEVICE_SUPPORTS_OP", "cmd", HELLO_LEN)
    assert "7.0.0" in exc.value.message


@pytest.mark.parametrize(("cmd", "size"), [(Command.ALLOC_BUFFER, 13), (Command.DEVICE_COUNT, 4),
                                           (Command.GET_TENSOR, 311), (Command.INIT_TENSOR, 1 << 40)])
def test_wrong_size_of_a_fixed_request(cmd, size):
    dec = after_hello()
    with pytest.raises(SizeMismatch) as exc:
        dec.feed(header(cmd, size))
    assert_names(exc.value, cmd.name, "size", HELLO_LEN + 1)
    assert str(size) in exc.value.message


def test_hello_of_wrong_size():
    with pytest.raises(SizeMismatch) as exc:
        RequestDecoder(V7).feed(header(Command.HELLO, 28))
    assert_names(exc.value, "HELLO", "size", 1)


@pytest.mark.parametrize(("protocol", "minimum"), [(V6, 304), (V7, 305)])
def test_set_tensor_shorter_than_its_header(protocol, minimum):
    dec = after_hello(protocol)
    with pytest.raises(SizeMismatch) as exc:
        dec.feed(header(Command.SET_TENSOR, minimum - 1))
    assert_names(exc.value, "SET_TENSOR", "size", HELLO_LEN + 1)
    assert str(minimum) in exc.value.message


@pytest.mark.parametrize("cmd", [Command.SET_TENSOR, Command.GRAPH_COMPUTE])
def test_size_claim_above_the_limit_is_refused_before_allocating(cmd):
    dec = after_hello(max_payload=1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(SizeLimitExceeded) as exc:
            dec.feed(header(cmd, 1 << 62))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
    assert_names(exc.value, cmd.name, "size", HELLO_LEN + 1)
    assert str(1 << 62) in exc.value.message and str(1 << 20) in exc.value.message


def test_a_large_claim_under_the_limit_waits_without_allocating():
    dec = after_hello()  # default limit: 4 GiB
    tracemalloc.start()
    try:
        assert dec.feed(header(Command.SET_TENSOR, 3 << 30) + bytes(1000)) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
    with pytest.raises(Truncated) as exc:
        dec.finish()
    assert_names(exc.value, "SET_TENSOR", "payload", HELLO_LEN)


def test_graph_counts_beyond_the_payload():
    """n_nodes claims 2^32-1 node ids in a 12-byte payload: refused, nothing allocated for the claim."""
    payload = struct.pack("<III", 0, 0xFFFFFFFF, 0)
    dec = after_hello()
    tracemalloc.start()
    try:
        with pytest.raises(SizeMismatch) as exc:
            dec.feed(header(Command.GRAPH_COMPUTE, len(payload)) + payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
    assert_names(exc.value, "GRAPH_COMPUTE", "nodes", HELLO_LEN + 9 + 8)
    payload = struct.pack("<IIQI", 0, 1, 5, 1000)
    with pytest.raises(SizeMismatch) as exc:
        after_hello().feed(header(Command.GRAPH_COMPUTE, len(payload)) + payload)
    assert_names(exc.value, "GRAPH_COMPUTE", "tensors", HELLO_LEN + 9 + 20)


@pytest.mark.parametrize(("protocol", "at"), [(V6, 296), (V7, 297)])  # v7 puts cache_flag before offset
def test_region_past_the_tensor_names_the_offset_field_where_it_is(protocol, at):
    req = encode_request(protocol, Command.SET_TENSOR, {"tensor": make_tensor(id=1, ne=(4, 1, 1, 1)), "offset": 12,
                                                        "cache_flag": 0}, data=bytes(8))
    with pytest.raises(SpecViolation) as exc:
        after_hello(protocol).feed(req)
    assert_names(exc.value, "SET_TENSOR", "offset", HELLO_LEN + 9 + at)


def test_graph_content_errors_name_the_field_where_it_is():
    empty = struct.pack("<IIQI", 0, 0, 0, 0)[:12]
    with pytest.raises(SpecViolation) as exc:
        after_hello().feed(header(Command.GRAPH_COMPUTE, len(empty)) + empty)
    assert_names(exc.value, "GRAPH_COMPUTE", "n_nodes", HELLO_LEN + 9 + 4)
    unknown = struct.pack("<IIQQI", 0, 2, 0x10, 0x20, 0)
    with pytest.raises(SpecViolation) as exc:
        after_hello().feed(header(Command.GRAPH_COMPUTE, len(unknown)) + unknown)
    assert_names(exc.value, "GRAPH_COMPUTE", "nodes[0]", HELLO_LEN + 9 + 8)


def test_hello_must_come_first():
    with pytest.raises(HandshakeError) as exc:
        RequestDecoder(V7).feed(encode_request(V7, Command.DEVICE_COUNT))
    assert_names(exc.value, "DEVICE_COUNT", "cmd", 0)


def test_second_hello():
    dec = after_hello()
    with pytest.raises(HandshakeError) as exc:
        dec.feed(HELLO)
    assert_names(exc.value, "HELLO", "cmd", HELLO_LEN)


def test_reply_without_pending_request():
    dec = ReplyDecoder(V7)
    with pytest.raises(UnexpectedReply) as exc:
        dec.feed(encode_reply(V7, Command.DEVICE_COUNT, {"device_count": 1}))
    assert_names(exc.value, None, "size", 0)


def test_reply_after_only_no_reply_commands_is_unexpected():
    dec = after_hello()
    reps = ReplyDecoder(V7)
    assert reps.expect(RequestDecoder(V7).feed(HELLO)[0]) is True
    reps.feed(encode_reply(V7, Command.HELLO, hello_reply((7, 0, 0))))
    for req in dec.feed(encode_request(V7, Command.FREE_BUFFER, {"remote_ptr": 1})
                        + encode_request(V7, Command.GRAPH_RECOMPUTE, {"device": 0})):
        assert reps.expect(req) is False
    assert reps.awaiting == 0
    with pytest.raises(UnexpectedReply) as exc:
        reps.feed(bytes(8))
    assert exc.value.offset == 8 + 28


def test_reply_of_wrong_size():
    (req,) = after_hello().feed(encode_request(V7, Command.GET_ALIGNMENT, {"device": 0}))
    dec = ReplyDecoder(V7)
    dec.expect(req)
    with pytest.raises(SizeMismatch) as exc:
        dec.feed(struct.pack("<Q", 4) + bytes(4))
    assert_names(exc.value, "GET_ALIGNMENT", "size", 0)
    assert "expected 8" in exc.value.message


def test_get_tensor_reply_size_comes_from_the_request():
    t = make_tensor(id=1, ne=(64,), buffer=1, data=0x1000)
    (req,) = after_hello().feed(encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16}))
    dec = ReplyDecoder(V7)
    dec.expect(req)
    with pytest.raises(SizeMismatch) as exc:
        dec.feed(struct.pack("<Q", 17))
    assert_names(exc.value, "GET_TENSOR", "size", 0)
    ok = ReplyDecoder(V7)
    ok.expect(req)
    (rep,) = ok.feed(struct.pack("<Q", 16) + bytes(range(16)))
    assert bytes(rep.data) == bytes(range(16)) and isinstance(rep.data, memoryview)


def test_reply_size_claim_above_the_limit():
    t = make_tensor(id=1, ne=(1 << 20,), buffer=1, data=0x1000)
    (req,) = after_hello(validate=False).feed(
        encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 1 << 40}))
    dec = ReplyDecoder(V7, max_payload=1 << 20)
    dec.expect(req)
    tracemalloc.start()
    try:
        with pytest.raises(SizeLimitExceeded) as exc:
            dec.feed(struct.pack("<Q", 1 << 40))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
    assert_names(exc.value, "GET_TENSOR", "size", 0)


def test_truncated_request_stream():
    dec = after_hello()
    wire = encode_request(V7, Command.ALLOC_BUFFER, {"device": 0, "size": 4096})
    assert dec.feed(wire[:15]) == []
    with pytest.raises(Truncated) as exc:
        dec.finish()
    assert_names(exc.value, "ALLOC_BUFFER", "payload", HELLO_LEN)
    dec = after_hello()
    dec.feed(wire[:5])
    with pytest.raises(Truncated) as exc:
        dec.finish()
    assert exc.value.offset == HELLO_LEN and "5 of 9" in exc.value.message


def test_truncated_reply_stream():
    (req,) = after_hello().feed(encode_request(V7, Command.GET_DEVICE_MEMORY, {"device": 0}))
    dec = ReplyDecoder(V7)
    dec.expect(req)
    wire = encode_reply(V7, Command.GET_DEVICE_MEMORY, {"free_mem": 1, "total_mem": 2})
    assert dec.feed(wire[:-1]) == []
    with pytest.raises(Truncated) as exc:
        dec.finish()
    assert_names(exc.value, "GET_DEVICE_MEMORY", "payload", 0)
    dec = ReplyDecoder(V7)
    dec.expect(req)
    dec.feed(wire[:3])
    with pytest.raises(Truncated) as exc:
        dec.finish()
    assert exc.value.offset == 0 and "3 of 8" in exc.value.message


def test_reply_decoder_never_waits_for_no_reply_commands():
    """No-reply requests interleaved with reply-bearing ones: each reply pairs with the right request."""
    t = make_tensor(id=1, ne=(4,), buffer=1, data=0x1000)
    wire = b"".join([
        encode_request(V6, Command.BUFFER_CLEAR, {"remote_ptr": 1, "value": 0}),
        encode_request(V6, Command.GET_ALIGNMENT, {"device": 0}),
        encode_request(V6, Command.SET_TENSOR, {"tensor": t, "offset": 0}, bytes(16)),
        encode_request(V6, Command.INIT_TENSOR, {"tensor": t}),
        encode_request(V6, Command.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 4, "value": 1}),
        encode_request(V6, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 4}),
        encode_request(V6, Command.FREE_BUFFER, {"remote_ptr": 1}),
    ])
    reqs = RequestDecoder(V6, expect_hello=False).feed(wire)
    reps = ReplyDecoder(V6)
    assert [reps.expect(r) for r in reqs] == [False, True, False, False, False, True, False]
    out = reps.feed(encode_reply(V6, Command.GET_ALIGNMENT, {"alignment": 32}))
    assert [(r.command, r.fields) for r in out] == [(Command.GET_ALIGNMENT, {"alignment": 32})]
    assert out[0].request is reqs[1] and reps.awaiting == 1
    (last,) = reps.feed(struct.pack("<Q", 4) + b"abcd")
    assert last.request is reqs[5] and bytes(last.data) == b"abcd" and reps.awaiting == 0
    reps.finish()
