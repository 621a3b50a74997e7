"""A served connection that polls its socket before sleeping (``ServerConfig.poll_us``) answers exactly as one that
sleeps at once: small requests, bulk data, requests split across the poll deadline, and a closing peer."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import ServerCore, make_config
from ggml_rpc.reference.server import serve_connection
from ggml_rpc.spec import V7, Command, encode_request, make_tensor


def _serve(poll_us: int) -> tuple[socket.socket, threading.Thread, list[str]]:
    ours, theirs = socket.socketpair()
    reasons: list[str] = []

    def run() -> None:
        try:
            reasons.append(serve_connection(theirs, ServerCore(make_config("7"), None), poll_us))
        finally:
            theirs.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ours.settimeout(10)
    return ours, thread, reasons


@pytest.mark.parametrize("poll_us", [0, 50, 200_000])
def test_results_do_not_depend_on_polling(poll_us: int) -> None:
    sock, thread, reasons = _serve(poll_us)
    payload = bytes(range(256)) * 4096  # 1 MiB: the bulk path reads it through the same poll
    with RpcClient(sock) as c:
        c.hello()
        for _ in range(50):
            assert c.get_alignment(0) == 32
        handle, _ = c.alloc_buffer(0, len(payload))
        base = c.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(len(payload) // 4,), buffer=handle, data=base)
        c.set_tensor(t, 0, payload)
        assert bytes(c.get_tensor(t, 0, len(payload))) == payload
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(reasons) == 1


def test_a_request_split_across_the_poll_deadline_is_read_whole() -> None:
    # 1 ms of polling, then the rest of the request 20 ms later: the server has gone to a blocking read by then.
    sock, thread, _ = _serve(1000)
    with RpcClient(sock) as c:
        c.hello()
        request = struct.pack("<BQI", Command.GET_ALIGNMENT, 4, 0)
        for cut in (1, 5, len(request) - 1):
            sock.sendall(request[:cut])
            time.sleep(0.02)
            sock.sendall(request[cut:])
            (size,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
            assert size == 8
            assert struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL)) == (32,)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_peer_that_closes_while_the_server_polls_ends_the_connection() -> None:
    sock, thread, reasons = _serve(200_000)
    with RpcClient(sock) as c:
        c.hello()
    sock.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert reasons and reasons[0]



def _set_tensor_request(c: RpcClient, payload: bytes) -> tuple[bytes, object]:
    """A SET_TENSOR of ``payload`` into a new buffer, as bytes, and its tensor."""
    handle, _ = c.alloc_buffer(0, len(payload))
    t = make_tensor(id=1, ne=(len(payload) // 4,), buffer=handle, data=c.buffer_get_base(handle))
    return encode_request(V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}, data=payload), t


@pytest.mark.parametrize("poll_us", [0, 200])
def test_a_payload_that_comes_in_pieces_past_the_bulk_retry_is_read_whole(poll_us: int) -> None:
    # Pieces 5 ms apart: each outlasts the bulk read's 30 us of retries, which must then sleep and go on.
    sock, thread, _ = _serve(poll_us)
    payload = bytes(range(256)) * 64
    with RpcClient(sock) as c:
        c.hello()
        request, t = _set_tensor_request(c, payload)
        first = len(request) - len(payload) + 100
        sock.sendall(request[:first])
        for at in range(first, len(request), 4096):
            time.sleep(0.005)
            sock.sendall(request[at : at + 4096])
        assert bytes(c.get_tensor(t, 0, len(payload))) == payload
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_peer_that_closes_inside_a_payload_while_the_server_retries_ends_the_connection() -> None:
    sock, thread, reasons = _serve(200)
    with RpcClient(sock) as c:
        c.hello()
        request, _ = _set_tensor_request(c, bytes(1 << 16))
        sock.sendall(request[: len(request) - (1 << 16) + 1000])
        time.sleep(0.01)
    sock.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert reasons and "payload" in reasons[0], reasons
