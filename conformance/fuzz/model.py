"""The fuzzer's oracle: the reference server's own per-connection logic, stepped in-process.

Each fuzzed connection has a twin :class:`ggml_rpc.reference.connection.Connection` served over a ``socketpair``.
The fuzzer writes a message's bytes into the pair, runs exactly one step of the reference dispatcher (the HELLO
handshake first, then one command per step) on the calling thread, and reads back whatever the reference wrote.
There is no second implementation of the rules: what the reference server answers is what the spec says.

The fuzzer only ever sends whole messages (or ends the connection after a cut one), so a step never waits for
bytes that will not come; a stall is reported as :class:`ModelStall` (a fuzzer bug, not a finding).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.reference.connection import Close, Connection, PeerGone, ServerConfig

#: Seconds a model step may wait for bytes before the fuzzer is declared inconsistent.
MODEL_STALL_SECONDS = 5.0
_PAIR_BUFFER = 4 << 20


class ModelStall(Exception):
    """The model waited for bytes the fuzzer never sends: the generator and the model disagree on framing."""


@dataclass(frozen=True, slots=True)
class ModelOutcome:
    """What the reference did with one message: the bytes it wrote, and whether (and why) it ended the connection."""

    reply: bytes
    closed: bool
    reason: str = ""


class ModelCache:
    """A hash cache directory private to the model, emptied at the start of every fuzz example."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="ggml-rpc-fuzz-model-cache-"))
        self.cache = HashCache(self._dir)

    @property
    def directory(self) -> Path:
        return self._dir

    def clear(self) -> None:
        clear_directory(self._dir)
        self.cache = HashCache(self._dir)

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def clear_directory(path: Path) -> None:
    """Delete every file of a cache directory (the directory itself stays)."""
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


class ModelConnection:
    """One connection of the reference server, driven synchronously one message at a time."""

    def __init__(self, config: ServerConfig, cache: HashCache | None, name: str = "model") -> None:
        self._server, self._client = socket.socketpair()
        for s in (self._server, self._client):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PAIR_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PAIR_BUFFER)
        self._server.settimeout(MODEL_STALL_SECONDS)
        self._client.setblocking(False)
        self.conn = Connection(self._server, config, cache, name=name)
        self._greeted = False
        self.closed = False
        self.reason = ""

    @property
    def buffers(self) -> dict:
        """The reference connection's live buffers, by handle (read-only use: bases for relocation)."""
        return self.conn.table.buffers

    def exchange(self, message: bytes | bytearray | memoryview, *, end: bool = False) -> ModelOutcome:
        """Feed one message (``end``: then close the client's side) and run the dispatcher once."""
        if self.closed:
            raise RuntimeError("model connection already closed")
        self._client.setblocking(True)
        try:
            if message:
                self._client.sendall(message)
            if end:
                self._client.shutdown(socket.SHUT_WR)
        finally:
            self._client.setblocking(False)
        try:
            # Fuzzed numbers through the executor (NaN, inf, overflowing casts) are expected, not worth a warning.
            with np.errstate(all="ignore"):
                if not self._greeted:
                    self.conn.handshake()
                    self._greeted = True
                else:
                    self.conn.step()
        except (Close, PeerGone) as exc:
            self._finish(str(exc))
        except TimeoutError:
            self._finish("model stalled")
            raise ModelStall("the model waited for more bytes than the fuzzer sent") from None
        except (ConnectionError, OSError) as exc:  # pragma: no cover - a socketpair does not fail
            self._finish(f"socket error: {exc}")
        except Exception as exc:  # what the reference server's loop does with its own errors: close
            self._finish(f"closed: internal error {type(exc).__name__}: {exc}")
        if end and not self.closed:
            # Everything the client will ever send is in: one more step sees the end of the stream.
            try:
                self.conn.step()
            except (Close, PeerGone) as exc:
                self._finish(str(exc))
        return ModelOutcome(self._drain(), self.closed, self.reason)

    def _drain(self) -> bytes:
        chunks = []
        while True:
            try:
                chunk = self._client.recv(1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def _finish(self, reason: str) -> None:
        self.closed = True
        self.reason = reason
        self.conn.release()
        try:
            self._server.close()
        except OSError:
            pass

    def close(self) -> None:
        if not self.closed:
            self._finish("client closed the connection")
        try:
            self._client.close()
        except OSError:
            pass
