"""The fuzzer's oracle: the reference server's own per-connection logic, driven in-process.

Each fuzzed connection has a twin :class:`ggml_rpc.reference.core.ServerCore`, the sans-IO core every connection
of the reference server runs.  The fuzzer feeds it a message's bytes, takes exactly one event (the HELLO exchange
first, then one command per message) on the calling thread, and keeps the reply it returned.  There is no second
implementation of the rules: what the reference server answers is what the spec says.

The fuzzer only ever sends whole messages (or ends the connection after a cut one), so a command never waits for
bytes that will not come; one that does is reported as :class:`ModelStall` (a fuzzer bug, not a finding).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ggml_rpc.reference import ServerConfig, ServerCore
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.reference.closing import Close, PeerGone
from ggml_rpc.reference.server import TcpLinks


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

    def __init__(self, config: ServerConfig, cache: HashCache | None, name: str = "model", *,
                 addresses: random.Random | None = None) -> None:
        # The same links as the server's: a COMM_INIT is judged by what the reference really does with it.
        # ``addresses``: seeded handles and bases (the reference's own are unguessable, so an example drew other
        # placements of buffers, and so other messages, each time it ran: a seed named no campaign).
        self.core = ServerCore(config, cache, name=name, links=TcpLinks(config), addresses=addresses)
        self.cache = cache
        self.closed = False
        self.reason = ""

    @property
    def buffers(self) -> dict:
        """The reference connection's live buffers, by handle (read-only use: bases for relocation)."""
        return self.core.table.buffers

    def exchange(self, message: bytes | bytearray | memoryview, *, end: bool = False) -> ModelOutcome:
        """Feed one message (``end``: then the end of the client's stream) and run one command (or the HELLO)."""
        if self.closed:
            raise RuntimeError("model connection already closed")
        core = self.core
        if message:
            core.receive_data(message)
        if end:
            core.receive_data(b"")
        reply: list = []
        try:
            # Fuzzed numbers through the executor (NaN, inf, overflowing casts) are expected, not worth a warning.
            with np.errstate(all="ignore"):
                out = self._next_event()
                if out is None:
                    raise ModelStall("the model waited for more bytes than the fuzzer sent")
                reply = list(out)
                if end:
                    # Everything the client will ever send is in: one more event sees the end of the stream.
                    reply.extend(self._next_event() or ())
        except (Close, PeerGone) as exc:
            self._finish(str(exc))
        except ModelStall:
            self._finish("model stalled")
            raise
        except Exception as exc:  # what the reference server's loop does with its own errors: close
            self._finish(f"closed: internal error {type(exc).__name__}: {exc}")
        # The reply is taken before the next message: it may be a view of memory that message writes.
        return ModelOutcome(b"".join(reply), self.closed, self.reason)

    def _next_event(self) -> Sequence | None:
        """The core's next event, its cache effects carried out as the server's I/O module carries them out."""
        core = self.core
        out = core.next_event()
        while out is None and core.effect is not None and self.cache is not None:
            core.effect_done(self.cache.carry_out(core.effect))
            out = core.next_event()
        return out

    def _finish(self, reason: str) -> None:
        self.closed = True
        self.reason = reason
        self.core.release()

    def close(self) -> None:
        if not self.closed:
            self._finish("client closed the connection")
