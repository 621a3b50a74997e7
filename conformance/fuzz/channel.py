"""The fuzzer's side of a connection to the server under test: send whole messages, read what comes back.

Every read has a deadline, so a server that neither answers nor closes is seen as a hang rather than waited for.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ggml_rpc.conformance.client import cork


class Refused(Exception):
    """The server does not accept connections any more."""


@dataclass(frozen=True, slots=True)
class Received:
    """What the server did within the deadline: ``data`` it sent, and whether it ``closed`` (EOF or reset)."""

    data: bytes
    closed: bool
    timed_out: bool
    #: The wait ended early: the server sat blocked reading its socket, so nothing more would come without input.
    idle: bool = False

    def waited(self, timeout: float) -> str:
        """How a wait that timed out ended, for a finding's message."""
        return "(it waits for more input)" if self.idle else f"within {timeout:g} s"


#: Seconds without a byte from the server after which a read asks whether it waits for input (when it can be told).
IDLE_AFTER = 0.1


class TargetConnection:
    """A TCP connection to the target, with bounded reads."""

    def __init__(self, host: str, port: int, *, timeout: float,
                 idle: Callable[[], bool | None] | None = None) -> None:
        self.timeout = timeout
        #: Asked during a read that waits (see :meth:`Target.waiting_for_input`): True ends the wait at once, as a
        #: timeout would end it later.
        self.idle = idle
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except ConnectionRefusedError as exc:
            raise Refused(f"connection refused by {host}:{port}") from exc
        except OSError as exc:
            raise Refused(f"cannot connect to {host}:{port}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.closed = False

    def send(self, data: bytes | bytearray | memoryview) -> bool:
        """Send everything; False when the server has already closed (reset / broken pipe)."""
        view = memoryview(data).cast("B")
        deadline = time.monotonic() + self.timeout
        while view.nbytes:
            try:
                n = self.sock.send(view)
                view = view[n:]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                select.select([], [self.sock], [], left)
            except OSError:
                return False
        return True

    def shutdown_write(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def read(self, n: int) -> Received:
        """Up to exactly ``n`` bytes, stopping early at EOF/reset, after the timeout, or as soon as the server is seen
        waiting for input (``idle``: what it has not sent by then, it will not send)."""
        out = bytearray()
        deadline = time.monotonic() + self.timeout
        quiet_since = time.monotonic()
        while len(out) < n:
            try:
                chunk = self.sock.recv(n - len(out))
            except BlockingIOError:
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    return Received(bytes(out), False, True)
                if self.idle is not None and now - quiet_since >= IDLE_AFTER:
                    if self.idle():
                        return Received(bytes(out), False, True, idle=True)
                    quiet_since = time.monotonic()
                select.select([self.sock], [], [], min(left, IDLE_AFTER) if self.idle is not None else left)
                continue
            except OSError:
                return Received(bytes(out), True, False)
            if not chunk:
                return Received(bytes(out), True, False)
            out += chunk
            quiet_since = time.monotonic()
        return Received(bytes(out), False, False)

    def pending(self) -> Received:
        """Bytes that already arrived (no waiting); ``closed`` if the server already closed."""
        out = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                return Received(bytes(out), False, False)
            except OSError:
                return Received(bytes(out), True, False)
            if not chunk:
                return Received(bytes(out), True, False)
            out += chunk

    def until_closed(self, limit: int = 1 << 16) -> Received:
        """Wait for the server to close; anything it sends first is returned (at most ``limit`` bytes)."""
        return self.read(limit)

    def leave(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` and close at once, its last bytes travelling with the FIN (see ``client.cork``)."""
        cork(self.sock)
        self.send(data)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass
