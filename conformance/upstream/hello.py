"""What an installed peer's server announces: the version of its HELLO reply, asked on loopback (the installers'
last step, and ``ggml-rpc upstream list``'s)."""

from __future__ import annotations

import socket
import struct
import subprocess
import tempfile
from pathlib import Path

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import free_port, wait_for_port

from .peers import LOOPBACK, Peer
from .runs import end_process, reason_line


class HelloError(Exception):
    """The installed server did not start or did not answer HELLO as a server does; the message says why."""


#: HELLO on the wire: command 14, its 24 connection-capability bytes (all zero); the reply is 28 bytes: major,
#: minor, patch, one pad byte, then the server's 24 capability bytes.
_HELLO = 14
_HELLO_CAPS = 24
_HELLO_REPLY = 28


def raw_hello(host: str, port: int, timeout: float = 20.0) -> tuple[int, int, int]:
    """The version a server announces, asked with a hand-made HELLO: this does not depend on the kit's client
    covering that version (8.0.0 servers are asked before the kit speaks protocol 8)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(bytes([_HELLO]) + struct.pack("<Q", _HELLO_CAPS) + bytes(_HELLO_CAPS))
        data = b""
        while len(data) < 8 + _HELLO_REPLY:
            chunk = sock.recv(8 + _HELLO_REPLY - len(data))
            if not chunk:
                raise HelloError(f"{host}:{port} closed the connection after {len(data)} bytes of the HELLO reply")
            data += chunk
    (size,) = struct.unpack_from("<Q", data)
    if size != _HELLO_REPLY:
        raise HelloError(f"{host}:{port} announced a HELLO reply of {size} bytes, expected {_HELLO_REPLY}")
    return data[8], data[9], data[10]


def server_hello(peer: Peer, timeout: float = 20.0, *, log: Path | None = None) -> tuple[int, int, int]:
    """Start the installed server on a free loopback port and return the version its HELLO announces (``log``:
    where to keep the server's output)."""
    port = free_port(LOOPBACK)
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        # The server's log goes to a file so that a server that does not start says why (a missing library).
        log = log or Path(cache) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(peer.server_argv(port), env=peer.env({"LLAMA_CACHE": cache}),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            if not wait_for_port(LOOPBACK, port, timeout, lambda: proc.poll() is None):
                why = reason_line(log.read_text(errors="replace"))
                raise HelloError(f"{peer.rpc_server} did not listen on {LOOPBACK}:{port} "
                                 f"(exit status {proc.poll()})" + (f": {why}" if why else ""))
            if peer.kind != "sdist":  # 8.0.0 builds: asked by hand, whatever protocols the kit's client speaks
                return raw_hello(LOOPBACK, port, timeout)
            with RpcClient.connect(LOOPBACK, port, timeout=timeout) as client:  # connect sends the HELLO
                return client.server_version
        finally:
            end_process(proc, 5.0)


__all__ = ["HelloError", "raw_hello", "server_hello"]
