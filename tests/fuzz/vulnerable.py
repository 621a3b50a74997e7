"""A deliberately vulnerable reference server, for tests only: protocol.md §10 item 16 re-enabled.

Upstream 6/7 checks that a tensor's data lies inside its buffer with an assertion, so a tensor with a valid buffer
handle and an address outside that buffer aborts the whole server process (remote denial of service).  The
reference server closes only the connection; this variant aborts its process instead, exactly as upstream does.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

from ggml_rpc.reference.connection import Close, Connection
from ggml_rpc.reference.server import Server
from ggml_rpc.spec import Command
from ggml_rpc.spec.codec import REPLY_HEADER


class AbortingConnection(Connection):
    """The reference connection, except that the buffer-range check kills the process (SIGABRT)."""

    def _tensor(self, t: Mapping[str, Any], command: str, what: str = "tensor"):
        try:
            return super()._tensor(t, command, what)
        except Close as exc:
            if "buffer-range assertion" in str(exc):
                os.abort()
            raise


class SilentMaxSizeConnection(Connection):
    """Never answers GET_MAX_SIZE (but goes on reading): the client waits for ever -- a hang."""

    def _get_max_size(self, f: dict[str, Any]) -> None:
        return None


class WrongAlignmentConnection(Connection):
    """Answers GET_ALIGNMENT with 64 where the reference configuration says 32 -- a wrong reply."""

    def _get_alignment(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_ALIGNMENT")
        self._reply(Command.GET_ALIGNMENT, {"alignment": 64})


class LeakyGetTensorConnection(Connection):
    """GET_TENSOR without the region check: reads past a tensor's buffer are answered with whatever follows (here
    zero bytes standing for neighbouring memory) -- out-of-buffer data in a reply."""

    def _get_tensor(self, f: dict[str, Any]) -> None:
        size = f["size"]
        if size > 1 << 20:
            raise Close("too large even for a leaky server")
        try:
            super()._get_tensor(f)
        except Close:
            self._send([REPLY_HEADER.pack(size), bytes(size)])


def server_with(connection_cls: type[Connection]) -> type[Server]:
    """A reference server class whose connections are ``connection_cls``."""

    class Variant(Server):
        def _handle(self, conn: socket.socket, peer: tuple) -> None:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection_cls(conn, self.config, self.cache, name=connection_cls.__name__).serve()
            finally:
                conn.close()

    Variant.__name__ = f"{connection_cls.__name__}Server"
    return Variant


#: Serves every connection with :class:`AbortingConnection`.
VulnerableServer = server_with(AbortingConnection)


def main() -> None:
    """``python vulnerable.py --port N [--proto 7]``: serve the vulnerable variant (for ``ggml-rpc fuzz --spawn``)."""
    import argparse

    from ggml_rpc.conformance.fuzz import fuzz_config
    from ggml_rpc.spec import parse_version_option

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--proto", default="7")
    args = p.parse_args()
    warnings.simplefilter("ignore")  # fuzzed numbers through the executor: NaN and overflow are expected
    server = VulnerableServer(fuzz_config(parse_version_option(args.proto)), "127.0.0.1", args.port)
    print(f"vulnerable reference server listening on 127.0.0.1:{server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
