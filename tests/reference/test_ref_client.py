"""The blocking client against a scripted peer on a socketpair: exact request bytes, reply handling, closes."""

from __future__ import annotations

import socket
import threading

import pytest
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.spec import V6, V7, V7_0_1, Command, RequestDecoder, SizeMismatch, encode_reply, make_tensor


class ScriptedPeer:
    """Decodes what the client sends and answers from a script: {command: reply fields or bytes}."""

    def __init__(self, sock: socket.socket, protocol, replies: dict) -> None:
        self.sock = sock
        self.protocol = protocol
        self.replies = replies
        self.requests = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dec = RequestDecoder(self.protocol, validate=False)
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            for req in dec.feed(chunk):
                self.requests.append(req)
                answer = self.replies.get(req.command)
                if callable(answer):
                    answer = answer(req)
                if answer is None:
                    continue
                if answer == "close":
                    self.sock.close()
                    return
                if isinstance(answer, bytes):
                    self.sock.sendall(answer)
                else:
                    self.sock.sendall(encode_reply(self.protocol, req.command, answer))


def pair(protocol, replies, *, forced=None, version=None):
    a, b = socket.socketpair()
    a.settimeout(5)
    hello = {"major": (version or protocol.version)[0], "minor": (version or protocol.version)[1],
             "patch": (version or protocol.version)[2], "pad": 0, "conn_caps": bytes(24)}
    peer = ScriptedPeer(b, protocol, {Command.HELLO: hello, **replies})
    client = RpcClient(a, forced)
    client.hello()
    return client, peer


def test_hello_learns_version() -> None:
    for proto in (V6, V7, V7_0_1):
        client, _peer = pair(proto, {})
        assert client.protocol is proto
        assert client.server_version == proto.version
        client.close()


def test_every_reply_command_round_trips() -> None:
    t = make_tensor(id=1, ne=(8,), buffer=0x10, data=0x1000)
    replies = {
        Command.DEVICE_COUNT: {"device_count": 3},
        Command.GET_ALIGNMENT: {"alignment": 32},
        Command.GET_MAX_SIZE: {"max_size": 2**64 - 1},
        Command.GET_DEVICE_MEMORY: {"free_mem": 5, "total_mem": 9},
        Command.ALLOC_BUFFER: {"remote_ptr": 0x10, "remote_size": 64},
        Command.BUFFER_GET_BASE: {"base_ptr": 0x1000},
        Command.SET_TENSOR_HASH: {"result": 1},
        Command.COPY_TENSOR: {"result": 0},
        Command.GET_ALLOC_SIZE: {"alloc_size": 96},
        Command.GET_TENSOR: lambda req: encode_reply(
            V7_0_1, Command.GET_TENSOR, None, bytes(range(req.fields["size"]))
        ),
        Command.GET_DEVICE_SUPPORTS_OP: {"supported": 1},
    }
    client, peer = pair(V7_0_1, replies)
    assert client.device_count() == 3
    assert client.get_alignment(0) == 32
    assert client.get_max_size(0) == 2**64 - 1
    assert client.get_device_memory(1) == (5, 9)
    assert client.alloc_buffer(0, 64) == (0x10, 64)
    assert client.buffer_get_base(0x10) == 0x1000
    assert client.set_tensor_hash(t, 0, 0xABC) is True
    assert client.copy_tensor(t, t) is False
    assert client.get_alloc_size(0, t, [t]) == 96
    assert bytes(client.get_tensor(t, 4, 16)) == bytes(range(16))
    assert client.supports_op(0, t) is True
    # No-reply commands return at once; the peer sees them in order.
    client.free_buffer(0x10)
    client.buffer_clear(0x10, 7)
    client.init_tensor(t)
    client.memset_tensor(t, 0, 8, 1)
    client.set_tensor(t, 4, b"abcd", cache_flag=1)
    client.graph_compute(0, [1], [t])
    client.graph_recompute(0)
    assert client.device_count() == 3  # a reply after the no-reply batch is still paired correctly
    cmds = [r.command for r in peer.requests]
    assert cmds[-8:] == [Command.FREE_BUFFER, Command.BUFFER_CLEAR, Command.INIT_TENSOR, Command.MEMSET_TENSOR,
                         Command.SET_TENSOR, Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE, Command.DEVICE_COUNT]
    st = next(r for r in peer.requests if r.command is Command.SET_TENSOR)
    assert st.fields["cache_flag"] == 1 and st.fields["offset"] == 4 and bytes(st.data) == b"abcd"
    assert st.size == 305 + 4
    gc = next(r for r in peer.requests if r.command is Command.GRAPH_COMPUTE)
    assert list(gc.fields["nodes"]) == [1] and int(gc.fields["tensors"][0]["id"]) == 1
    client.close()


def test_v6_set_tensor_layout_and_flag_refused() -> None:
    t = make_tensor(id=1, ne=(8,), buffer=0x10, data=0x1000)
    client, peer = pair(V6, {Command.DEVICE_COUNT: {"device_count": 1}})
    client.set_tensor(t, 0, b"\x01\x02")
    with pytest.raises(ValueError):
        client.set_tensor(t, 0, b"\x01", cache_flag=1)
    assert client.device_count() == 1
    st = next(r for r in peer.requests if r.command is Command.SET_TENSOR)
    assert st.size == 304 + 2 and "cache_flag" not in st.fields
    client.close()


def test_forced_protocol_encodes_its_own_layout() -> None:
    t = make_tensor(id=1, ne=(8,), buffer=0x10, data=0x1000)
    # The peer decodes as v7 but the client forces v6: the v6 header is one byte shorter.
    client, peer = pair(V7, {Command.DEVICE_COUNT: {"device_count": 1}}, forced=V6)
    assert client.protocol is V6 and client.server_version == (7, 0, 0)
    client.set_tensor(t, 0, b"\x00" * 8)
    assert client.device_count() == 1
    st = next(r for r in peer.requests if r.command is Command.SET_TENSOR)
    assert st.size == 304 + 8
    client.close()


def test_supports_op_refused_before_7_0_1() -> None:
    client, _peer = pair(V7, {})
    with pytest.raises(Exception, match="GET_DEVICE_SUPPORTS_OP"):
        client.supports_op(0, make_tensor(id=1))
    client.close()


def test_close_instead_of_reply_raises() -> None:
    client, _peer = pair(V7, {Command.GET_ALIGNMENT: "close"})
    with pytest.raises(ConnectionClosed):
        client.get_alignment(0)
    client.close()


def test_wrong_reply_size_is_refused() -> None:
    client, _peer = pair(V7, {Command.GET_ALIGNMENT: b"\x04\0\0\0\0\0\0\0\x20\0\0\0"})
    with pytest.raises(SizeMismatch):
        client.get_alignment(0)
    client.close()


def test_expect_closed() -> None:
    client, _peer = pair(V7, {Command.DEVICE_COUNT: "close"})
    assert client.expect_closed(0.05) is False  # still open, nothing sent
    client.send_raw(b"\x0f" + bytes(8))
    assert client.expect_closed(2.0) is True
    client.close()


def test_raw_reply() -> None:
    client, _peer = pair(V7, {Command.DEVICE_COUNT: {"device_count": 2}})
    client.send_raw([b"\x0f", bytes(8)])
    assert bytes(client.recv_reply_raw()) == b"\x02\0\0\0"
    client.close()


def test_a_corked_request_is_held_back_until_the_fin():
    # What makes an early close deterministic: the peer sees nothing of the request before the client is gone,
    # then the whole request and the end of the stream together.
    if not hasattr(socket, "TCP_CORK"):
        pytest.skip("TCP_CORK is Linux-only")
    with socket.create_server(("127.0.0.1", 0)) as ls:
        client = RpcClient(socket.create_connection(ls.getsockname()))
        peer, _ = ls.accept()
        with peer:
            peer.setblocking(False)
            client.cork()
            client.send_raw(b"\x0a" + bytes(8))
            with pytest.raises(BlockingIOError):
                peer.recv(64)  # corked: held back (uncorked, loopback delivers it within send)
            client.close()
            peer.settimeout(5)
            got = b""
            while chunk := peer.recv(64):
                got += chunk
            assert got == b"\x0a" + bytes(8)
