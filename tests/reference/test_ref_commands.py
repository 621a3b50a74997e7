"""Every command of protocol 6, 7 and 7.0.1 through the client, with the answers upstream's CPU server gives."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference import CPU_ALIGNMENT, CPU_MAX_SIZE, DEFAULT_MEMORY, running_server
from ggml_rpc.spec import Command, GgmlOp, GgmlType, make_tensor
from refhelpers import assert_served, connect, send_only, tensor_in


def test_hello_and_device_queries(srv) -> None:
    with connect(srv) as c:
        assert c.server_version == srv.protocol.version
        assert c.protocol is srv.protocol
        assert c.device_count() == 1
        assert c.get_alignment(0) == CPU_ALIGNMENT == 32
        assert c.get_max_size(0) == CPU_MAX_SIZE == 2**64 - 1
        assert c.get_device_memory(0) == (DEFAULT_MEMORY, DEFAULT_MEMORY)


def test_hello_reply_bytes(srv) -> None:
    with connect(srv, hello=False) as c:
        c.send_raw(b"\x0e" + (24).to_bytes(8, "little") + b"\xff" * 24)  # caps are ignored
        reply = bytes(c.recv_reply_raw())
        assert reply == bytes([srv.protocol.version[0], 0, srv.protocol.version[2], 0]) + bytes(24)


def test_buffers_and_memory_accounting(srv) -> None:
    with connect(srv) as c:
        h1, s1 = c.alloc_buffer(0, 4096)
        h2, s2 = c.alloc_buffer(0, 1 << 20)
        assert h1 and h2 and h1 != h2 and (s1, s2) == (4096, 1 << 20)
        b1, b2 = c.buffer_get_base(h1), c.buffer_get_base(h2)
        assert b1 % 32 == 0 and b2 % 32 == 0 and b1 != b2
        assert b1 + 4096 <= b2 or b2 + (1 << 20) <= b1  # distinct address ranges
        assert c.get_device_memory(0) == (DEFAULT_MEMORY - 4096 - (1 << 20), DEFAULT_MEMORY)
        c.free_buffer(h1)
        assert c.get_device_memory(0) == (DEFAULT_MEMORY - (1 << 20), DEFAULT_MEMORY)
        c.buffer_clear(h2, 0xAB)
        t = make_tensor(id=5, ne=(1 << 18,), buffer=h2, data=b2)
        assert bytes(c.get_tensor(t, 100, 4)) == b"\xab" * 4
    with connect(srv) as c:  # buffers die with their connection
        assert c.get_device_memory(0) == (DEFAULT_MEMORY, DEFAULT_MEMORY)


def test_alloc_zero_is_a_dummy_buffer(srv) -> None:
    with connect(srv) as c:
        handle, size = c.alloc_buffer(0, 0)
        assert handle != 0 and size == 0
        assert c.buffer_get_base(handle) == 0
        c.buffer_clear(handle, 1)  # no-op
        c.free_buffer(handle)
        assert c.device_count() == 1


def test_alloc_beyond_budget_answers_zero() -> None:
    with running_server("7", mem=1 << 20) as srv, connect(srv) as c:
        assert c.alloc_buffer(0, (1 << 20) + 1) == (0, 0)
        h, _ = c.alloc_buffer(0, 1 << 19)
        assert h
        assert c.alloc_buffer(0, (1 << 19) + 1) == (0, 0)
        assert c.get_device_memory(0) == (1 << 19, 1 << 20)
        assert c.alloc_buffer(0, 1 << 19)[0] != 0  # exactly what is left


def test_set_get_roundtrip(srv) -> None:
    payload = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 8192)
        c.set_tensor(t, 0, payload)
        c.set_tensor(t, 100, b"hello")
        got = bytes(c.get_tensor(t, 0, 8192))
        assert got == payload[:100] + b"hello" + payload[105:]
        assert bytes(c.get_tensor(t, 8190, 2)) == payload[8190:]
        c.set_tensor(t, 0, b"")  # n == 0 inside the buffer: accepted, no-op
        assert bytes(c.get_tensor(t, 0, 0)) == b""


def test_set_tensor_v7_cache_flag_layout() -> None:
    with running_server("7") as srv, connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        c.set_tensor(t, 8, b"\x01\x02\x03", cache_flag=1)  # no cache dir: the flag changes nothing
        assert bytes(c.get_tensor(t, 7, 5)) == b"\x00\x01\x02\x03\x00"


def test_view_tensor_offsets(srv) -> None:
    with connect(srv) as c:
        t, h, base = tensor_in(c, 1024)
        c.set_tensor(t, 0, bytes(range(256)) * 4)
        view = make_tensor(id=2, ne=(16,), buffer=h, data=base + 512, view_src=1, view_offs=512)
        assert bytes(c.get_tensor(view, 0, 64)) == (bytes(range(256)) * 4)[512:576]


def test_memset_tensor(srv) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 256)
        c.memset_tensor(t, 10, 20, 0x5A)
        c.memset_tensor(t, 0, 0, 0xFF)  # size 0: no-op
        data = bytes(c.get_tensor(t, 0, 256))
        assert data == bytes(10) + b"\x5a" * 20 + bytes(226)


def test_copy_tensor(srv) -> None:
    with connect(srv) as c:
        src, _h1, _b1 = tensor_in(c, 512, id=1)
        dst, _h2, _b2 = tensor_in(c, 1024, id=2)
        c.set_tensor(src, 0, b"\x07" * 512)
        assert c.copy_tensor(src, dst) is True
        assert bytes(c.get_tensor(dst, 0, 1024)) == b"\x07" * 512 + bytes(512)


def test_copy_tensor_overlapping_in_one_buffer(srv) -> None:
    with connect(srv) as c:
        whole, h, base = tensor_in(c, 64, ne=(64,), type=GgmlType.I8)
        c.set_tensor(whole, 0, bytes(range(64)))
        src = make_tensor(id=2, type=GgmlType.I8, ne=(32,), buffer=h, data=base)
        dst = make_tensor(id=3, type=GgmlType.I8, ne=(32,), buffer=h, data=base + 16)
        assert c.copy_tensor(src, dst)
        assert bytes(c.get_tensor(whole, 0, 64)) == bytes(range(16)) + bytes(range(32)) + bytes(range(48, 64))


def test_init_tensor_and_alloc_size(srv) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 4096, type=GgmlType.Q4_0, ne=(4096 // 18 * 32 // 32 * 32,))
        c.init_tensor(t)
        # A Q4_0 row of 224 elements: 7 blocks of 18 bytes; CPU buffers allocate exactly nbytes.
        q = make_tensor(id=9, type=GgmlType.Q4_0, ne=(224, 3))
        assert c.get_alloc_size(0, q) == 7 * 18 * 3
        assert c.get_alloc_size(0, make_tensor(id=10, ne=(5, 7)), [q]) == 140
        c.init_tensor(make_tensor(id=11, ne=(4,)))  # no buffer: logged and ignored, as upstream
        assert c.device_count() == 1


def test_graph_compute_and_recompute_reach_the_executor(srv) -> None:
    calls = []
    with running_server(srv.protocol, executor=lambda nodes: calls.append(nodes)) as s2, connect(s2) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1)
        b = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32)
        out = make_tensor(id=3, ne=(8,), buffer=h, data=base + 32, op=GgmlOp.ADD, src=[1, 2], flags=16)
        c.graph_compute(0, [3], [a, b, out])
        c.graph_recompute(0)
        assert c.device_count() == 1  # both were accepted
    assert len(calls) == 2 and calls[0] is calls[1]
    node = calls[0][0]
    assert node.id == 3 and node.op == GgmlOp.ADD and node.src[0].id == 1 and node.src[1].id == 2
    assert node.offset == 32 and node.nbytes == 32 and node.buffer is not None and node.buffer.nbytes == 64


def test_supports_op_is_answered(srv701) -> None:
    with connect(srv701) as c:
        node = make_tensor(id=3, ne=(8,), op=GgmlOp.ADD, src=[1, 2])
        a = make_tensor(id=1, ne=(8,))
        assert c.supports_op(0, node, [a, a]) is True  # the executor runs F32 ADD
        custom = make_tensor(id=4, ne=(8,), op=GgmlOp.CUSTOM)
        assert c.supports_op(0, custom) is False


def test_many_devices() -> None:
    with running_server("6", devices=3, mem=1 << 30, alignment=64, max_size=1 << 40) as srv, connect(srv) as c:
        assert c.device_count() == 3
        for d in range(3):
            assert c.get_alignment(d) == 64
            assert c.get_max_size(d) == 1 << 40
            assert c.get_device_memory(d) == (1 << 30, 1 << 30)
        h, _ = c.alloc_buffer(2, 1 << 20)
        assert c.buffer_get_base(h) % 64 == 0
        assert c.get_device_memory(2)[0] == (1 << 30) - (1 << 20)
        assert c.get_device_memory(0)[0] == 1 << 30


def test_no_reply_commands_are_not_answered(srv) -> None:
    with connect(srv) as c:
        t, h, _b = tensor_in(c, 64)
        for cmd, fields in [
            (Command.BUFFER_CLEAR, {"remote_ptr": h, "value": 0}),
            (Command.INIT_TENSOR, {"tensor": t}),
            (Command.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 4, "value": 1}),
        ]:
            send_only(c, cmd, fields)
        # Had any of them been answered, these bytes would come before the DEVICE_COUNT reply.
        send_only(c, Command.DEVICE_COUNT)
        assert bytes(c.recv_reply_raw()) == (1).to_bytes(4, "little")
        send_only(c, Command.FREE_BUFFER, {"remote_ptr": h})
        assert c.expect_closed(0.2) is False


def test_one_connection_at_a_time(srv) -> None:
    with connect(srv) as first:
        second = connect(srv, hello=False)
        try:
            second.send_raw(b"\x0e" + (24).to_bytes(8, "little") + bytes(24))
            second.sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                second.sock.recv(1)  # waits in the backlog while the first is served
            assert first.device_count() == 1
            first.close()
            second.sock.settimeout(5)
            assert len(second.recv_reply_raw()) == 28
        finally:
            second.close()
    assert_served(srv)


def test_concurrent_mode_serves_in_parallel() -> None:
    with running_server("7", concurrent=True) as srv, connect(srv) as a, connect(srv) as b:
        ta, _h, _ = tensor_in(a, 64)
        tb, _h2, _ = tensor_in(b, 64)
        a.set_tensor(ta, 0, b"A" * 64)
        b.set_tensor(tb, 0, b"B" * 64)
        assert bytes(a.get_tensor(ta, 0, 4)) == b"AAAA" and bytes(b.get_tensor(tb, 0, 4)) == b"BBBB"
        # Handles are per connection: b cannot use a's buffer.
        assert b.get_alloc_size(0, ta) == 64


def test_handles_are_per_connection(srv) -> None:
    with connect(srv) as c:
        _t, h, _b = tensor_in(c, 64)
    with connect(srv) as c:
        send_only(c, Command.BUFFER_GET_BASE, {"remote_ptr": h})
        assert c.expect_closed(10)
    assert_served(srv)
