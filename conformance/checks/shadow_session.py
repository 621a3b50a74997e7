"""A check's connection under the shadow-memory oracle: the server under test and its mirror, the reference core fed
the same requests in this process.

What this module may know: one connection to the server (a check's :class:`~ggml_rpc.conformance.client.RpcClient`)
and a reference :class:`~ggml_rpc.reference.ServerCore` driven one message at a time (the mirror: what the spec says
the session's buffers hold), the relocation of handles and addresses between the two, and the oracle
(:mod:`ggml_rpc.conformance.harness.shadow`). It must not know which check uses it, or judge anything but bytes.

A session allocates its buffers on both sides and fills each with canaries (known pseudo-random bytes): a sentinel,
the working buffer, a sentinel, in that order, so that a write past the working buffer meets a sentinel first on a
server whose allocator places them side by side. :meth:`ShadowSession.write` sends one request to both; then
:meth:`ShadowSession.verify` reads every buffer back whole and fails the check with the oracle's evidence (which
buffer, which offsets, the bytes expected and got) when a byte the shadow knows differs.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.conformance.checks._support import alloc, fail
from ggml_rpc.conformance.checks.deaths import expect_open_or_closed
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import CheckFailed, Context, hexdump
from ggml_rpc.conformance.harness.shadow import Corruption, Read, ShadowMemory, canary_bytes, destination
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.reference import ServerCore, make_config
from ggml_rpc.reference.cache import HashCache
from ggml_rpc.reference.closing import Close, PeerGone
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, GgmlType, Protocol, encode_request, make_tensor
from ggml_rpc.spec.codec import REPLY_HEADER_SIZE
from ggml_rpc.spec.geometry import Seeded, Span

#: Roles of a session's three buffers, in allocation order.
ROLES = ("sentinel before the working buffer", "the working buffer", "sentinel after the working buffer")


class Mirror:
    """The reference core of one connection, fed whole requests, one command per event."""

    def __init__(self, protocol: Protocol) -> None:
        # A cache of its own, filled by the requests the session sends: the mirror hits where a server with a cache
        # hits (a server without one misses where the mirror hits: the session does not judge that destination).
        self._cache_dir = tempfile.TemporaryDirectory(prefix="ggml-rpc-shadow-mirror-")
        self.cache = HashCache(Path(self._cache_dir.name))
        self.core = ServerCore(make_config(protocol), self.cache, name="shadow mirror")
        self.closed = False
        self.reason = ""
        self.exchange(encode_request(protocol, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)}))

    @property
    def buffers(self) -> Mapping[int, Any]:
        return self.core.table.buffers

    def exchange(self, wire: bytes) -> bytes:
        """The reply bytes of one request (b"" for none); a refusal closes the mirror (``closed``, ``reason``)."""
        if self.closed:
            raise RuntimeError("the mirror is closed")
        self.core.receive_data(wire)
        try:
            with np.errstate(all="ignore"):
                out = self.core.next_event()
                while out is None and self.core.effect is not None:
                    # The core asks its cache through effects: carried out here, as the server's I/O module does.
                    self.core.effect_done(self.cache.carry_out(self.core.effect))
                    out = self.core.next_event()
        except (Close, PeerGone) as exc:
            self.closed, self.reason = True, str(exc)
            return b""
        if out is None:
            raise RuntimeError("the mirror waited for more bytes than a whole request")
        return b"".join(bytes(p) for p in out)

    def close(self) -> None:
        if not self.closed:
            self.closed, self.reason = True, "closed"
        self.core.release()
        self._cache_dir.cleanup()


@dataclass(frozen=True, slots=True)
class SessionBuffer:
    """A buffer of the session: the mirror's handle and base (what requests are written with) and the server's."""

    span: Span
    target_handle: int
    target_base: int
    role: str


class ShadowSession:
    """One connection to the server under test, its mirror and the oracle over the mirror's buffers."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.protocol = ctx.protocol
        self.client: RpcClient = ctx.connect()
        self.mirror = Mirror(self.protocol)
        self.reloc = Relocator()
        self.shadow = ShadowMemory(self.mirror.buffers, seed=int(ctx.rng().integers(1 << 62)))
        self.buffers: list[SessionBuffer] = []
        self.chooser = Seeded(random.Random(int(ctx.rng().integers(1 << 62))))
        self._ids = 0x5AD0

    @classmethod
    def open(cls, ctx: Context, work: int = 4096, sentinel: int = 1024) -> ShadowSession:
        """A session with a sentinel, the working buffer and a sentinel, all three filled with canaries."""
        s = cls(ctx)
        for size, role in zip((sentinel, work, sentinel), ROLES, strict=True):
            s.alloc(size, role)
        return s

    @property
    def work(self) -> SessionBuffer:
        return self.buffers[1]

    @property
    def sentinels(self) -> tuple[SessionBuffer, SessionBuffer]:
        return self.buffers[0], self.buffers[2]

    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def close(self) -> None:
        self.client.close()
        self.mirror.close()

    # ---- requests to both sides -------------------------------------------------------------------------------

    def alloc(self, size: int, role: str) -> SessionBuffer:
        """ALLOC_BUFFER + BUFFER_GET_BASE on both sides, then canaries over the whole buffer."""
        theirs = alloc(self.client, size)
        p = self.protocol
        reply = self.mirror.exchange(encode_request(p, Command.ALLOC_BUFFER, {"device": 0, "size": size}))
        handle = int.from_bytes(reply[REPLY_HEADER_SIZE : REPLY_HEADER_SIZE + 8], "little")
        reply = self.mirror.exchange(encode_request(p, Command.BUFFER_GET_BASE, {"remote_ptr": handle}))
        base = int.from_bytes(reply[REPLY_HEADER_SIZE : REPLY_HEADER_SIZE + 8], "little")
        self.reloc.buffer(handle, theirs.handle)
        self.reloc.base(handle, base, theirs.base)
        buf = SessionBuffer(Span(handle, base, size), theirs.handle, theirs.base, role)
        self.buffers.append(buf)
        whole = self.whole(buf)
        fields: dict[str, Any] = {"tensor": whole, "offset": 0}
        flag = p.cache_rule.flag_field
        if flag:
            fields[flag] = 0
        data = canary_bytes(size, int(self.ctx.rng().integers(1 << 62)))
        self.mirror.exchange(encode_request(p, Command.SET_TENSOR, fields, data))
        self.client.request(Command.SET_TENSOR, self.reloc.fields(fields), data)
        self.shadow.mark(handle, role=role)
        return buf

    def whole(self, buf: SessionBuffer) -> dict:
        """An I8 tensor over the whole buffer (mirror handle and base)."""
        s = buf.span
        return make_tensor(id=0x5AD0_0000 + self.buffers.index(buf), type=int(GgmlType.I8), ne=(s.size,),
                           buffer=s.handle, data=s.base)

    def others(self, of: SessionBuffer) -> list[Span]:
        """The session's other buffers where the *server* placed them relative to ``of`` (in ``of``'s mirror frame):
        a tensor placed inside one relocates into the server's real other buffer."""
        return [Span(b.span.handle, of.span.base + (b.target_base - of.target_base), b.span.size)
                for b in self.buffers if b is not of]

    def write(self, command: Command, fields: dict[str, Any], data: bytes | None = None, *,
              what: str = "") -> tuple[str, bytes]:
        """Send one request to the mirror and the server: ("done", the server's reply payload) when the mirror ran
        it, ("refused", b"") when the mirror refused it and the server closed too, ("accepted", payload) when the
        server went on where the mirror refused (the oracle then judges what it wrote). ``what``: the request in
        words, noted with its bytes (the step a death is blamed on)."""
        wire = encode_request(self.protocol, command, fields, data)
        mirror_reply = self.mirror.exchange(wire)
        relocated = self.reloc.fields(fields)
        if what:
            self.ctx.note(what, sent=hexdump(encode_request(self.protocol, command, relocated, data), 48),
                          expected="processed, or closed where the reference closes" if self.mirror.closed else
                          "processed")
        if not self.mirror.closed:
            reply = self.client.request(command, relocated, data)
            self.shadow.after(command, fields)
            if reply is None:
                return "done", b""
            payload = bytes(reply.raw) if reply.raw is not None else b""
            if command is Command.SET_TENSOR_HASH and payload[:1] != mirror_reply[REPLY_HEADER_SIZE:][:1]:
                # The server's cache is its own: where it hit and the mirror missed (or the reverse), the destination
                # holds what that server's cache gave; every other byte is still judged.
                dest = destination(command, fields, self.mirror.buffers)
                t = self.shadow.tracked.get(dest[0]) if dest is not None else None
                if t is not None and dest is not None:
                    t.known.remove(dest[1], dest[2])
            return "done", payload
        sent = encode_request(self.protocol, command, relocated, data)
        try:
            self.client.send_raw(sent)
            if self.protocol.commands[command].has_reply:
                # A reply where the mirror closes: take it before the oracle's own requests (a command without one
                # goes straight to the probe: waiting for its reply cost a whole timeout per accepted request).
                self.client.recv_reply_raw()
        except ConnectionClosed:
            return "refused", b""
        except TimeoutError:
            pass  # neither a reply nor a close yet: the probe below decides
        how = expect_open_or_closed(self.ctx, self.client, sent, f"{command.name} the reference refuses "
                                    f"({self.mirror.reason})")
        return ("refused" if how == "refused" else "accepted"), b""

    # ---- judging -----------------------------------------------------------------------------------------------

    def verify(self, what: str, *, destination: tuple[int, int, int] | None = None, accepted: bool = False) -> None:
        """Read every buffer of the session back whole and judge it; a corruption fails the check with evidence.

        ``accepted``: the server went on where the mirror refused; the bytes of ``destination`` (what the request
        named) are then the server's own business, every other known byte must be as it was."""
        if accepted and destination is not None:
            handle, lo, hi = destination
            t = self.shadow.tracked.get(handle)
            if t is not None:
                t.known.remove(lo, hi)
        for buf in self.buffers:
            t = self.shadow.tracked.get(buf.span.handle)
            if t is None or not t.known.total:
                continue
            got = bytes(self.client.get_tensor(self.reloc.tensor(self.whole(buf)), 0, buf.span.size))
            corruption = self.shadow.judge(Read(buf.span.handle, 0, buf.span.size), got, destination=destination)
            if corruption is not None:
                raise corruption_failure(what, corruption)


def corruption_failure(what: str, c: Corruption) -> CheckFailed:
    """The check's failure for a corruption: where, and the bytes (expected and got) around the first change."""
    return fail(f"{what}: {c.buffer} changed, {c.where or 'a buffer of the session'}: {c.changed} byte(s) at "
                f"offsets {c.spans_text()}", expected=f"at offset {c.at}: {hexdump(c.expected, 32)}",
                got=f"at offset {c.at}: {hexdump(c.got, 32)}")


__all__ = ["ROLES", "Mirror", "SessionBuffer", "ShadowSession", "corruption_failure"]
