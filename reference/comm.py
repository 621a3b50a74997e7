"""The reference connection's communicator of 8.0.0: COMM_INIT, COMM_ALLREDUCE and COMM_FREE (a handler table over
the connection's resolver, reply queue and the injected :class:`Links`), and the interface of the servers' own link
that carries the partial sums (its sockets are :mod:`.server`'s: the core asks for a link and for an exchange on it).

With tensor split a client asks two servers to join one communicator: rank 0 listens on a port for its peer, rank 1
connects to it (upstream retries for about five seconds).  The link opens with both sides' 24 caps bytes (the
connector's first; all zero over plain TCP) and then carries, for every COMM_ALLREDUCE, each rank's copy of the
tensor: rank 0 sends first, rank 1 receives first, so large tensors cannot deadlock.  An F32 tensor of 32,768
elements or more travels as BF16 (rounded to nearest even), halving the bytes; each rank adds the peer's copy to its
own, so with BF16 the two ranks' sums differ in the last bits, as upstream's do.

Safety rules of the reference: it binds rank 0's port on the address it serves on (never all interfaces) and
connects only to loopback hosts unless the server is configured otherwise; a peer that does not come within the
configured time makes COMM_INIT answer 0 instead of blocking the connection forever; a tensor larger than the
server's limit for one transfer is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from ggml_rpc.spec import Command
from ggml_rpc.spec.enums import TYPES
from ggml_rpc.spec.facts import comm_wire_type

from .closing import Close
from .closing import upstream as _upstream
from .replies import Replies
from .resolve import Resolver

log = logging.getLogger("ggml_rpc.reference")


_F32, _F16, _BF16 = (next(t.id for t in TYPES.values() if t.name == n) for n in ("F32", "F16", "BF16"))


class Link(Protocol):
    """An open link to the other server of a communicator."""

    def exchange(self, data: bytes, *, send_first: bool) -> bytes:
        """Send ``data`` and receive as many bytes from the peer (rank 0 sends first, rank 1 receives first, so
        large tensors cannot deadlock); raises OSError or ConnectionError when the link fails."""
        ...

    def close(self) -> None:
        """Close the link (idempotent, never raises)."""
        ...


class Links(Protocol):
    """Opens the servers' link for COMM_INIT."""

    def open(self, rank: int, host: str, port: int) -> Link:
        """Rank 0: listen on ``port`` for the peer; rank 1: connect to ``host:port``; both then exchange caps.
        Raises OSError, ConnectionError or ValueError (a refused port or host) when no link opens."""
        ...


@dataclass
class Communicator:
    """One device's membership of a two-rank communicator: its rank and the open link to the other server."""

    rank: int
    link: Link

    def close(self) -> None:
        self.link.close()


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even; NaN stays a quiet NaN."""
    u = values.view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class CommCommands:
    """COMM_INIT, COMM_ALLREDUCE, COMM_FREE, and each device's membership of a communicator."""

    def __init__(self, devices: int, resolve: Resolver, out: Replies, links: Links | None, *, name: str) -> None:
        self.devices = devices
        self.resolve = resolve
        self.out = out
        #: Opens the servers' link for COMM_INIT (None: this connection has none, COMM_INIT answers 0).
        self.links = links
        self.name = name
        #: Each device's membership of a communicator (COMM_INIT), with its link to the other server.
        self.comms: dict[int, Communicator] = {}
        self.handlers: dict[Command, Callable[[dict[str, Any]], None]] = {
            Command.COMM_INIT: self.init, Command.COMM_ALLREDUCE: self.allreduce, Command.COMM_FREE: self.free}

    def init(self, f: dict[str, Any]) -> None:
        device, rank, world, port = f["device"], f["rank"], f["world"], f["port"]
        host = bytes(f["host"]).split(b"\0", 1)[0].decode("latin-1")
        if device >= self.devices or world != 2 or rank >= world:
            log.info("%s: COMM_INIT device %d rank %d of %d: only two ranks are served", self.name, device, rank,
                     world)
            self.out.reply(Command.COMM_INIT, {"ok": 0})
            return
        if device in self.comms:
            self.out.reply(Command.COMM_INIT, {"ok": 1})  # already joined, as upstream answers
            return
        try:
            if self.links is None:
                raise ConnectionError("this server opens no links to other servers")
            link = self.links.open(rank, host, port)
        except (OSError, ConnectionError, ValueError) as exc:
            log.info("%s: COMM_INIT device %d rank %d: %s", self.name, device, rank, exc)
            self.out.reply(Command.COMM_INIT, {"ok": 0})
            return
        self.comms[device] = Communicator(rank, link)
        log.info("%s: device %d joined the communicator as rank %d", self.name, device, rank)
        self.out.reply(Command.COMM_INIT, {"ok": 1})

    def allreduce(self, f: dict[str, Any]) -> None:
        device = self.resolve.device(f["device"], "COMM_ALLREDUCE")
        comm = self.comms.get(device)
        if comm is None:
            raise Close(f"COMM_ALLREDUCE: device {device} has no communicator (no COMM_INIT){_upstream('close')}")
        t = self.resolve.tensor(f["tensor"], "COMM_ALLREDUCE")
        if t.buffer is None:
            raise Close(f"COMM_ALLREDUCE: tensor has no buffer (null or unknown handle){_upstream('close')}")
        if t.nbytes == 0:
            return
        ttype, ne = f["tensor"]["type"], [int(x) for x in f["tensor"]["ne"]]
        count = int(np.prod(ne, dtype=np.uint64))
        if ttype not in (_F32, _F16, _BF16):
            raise Close(f"COMM_ALLREDUCE: tensor type {TYPES[ttype].name} is not summed by the reference "
                        f"(F32, F16, BF16)")
        if t.nbytes != count * TYPES[ttype].size:
            raise Close("COMM_ALLREDUCE: a tensor that is not contiguous is not summed by the reference")
        region = t.buffer.slice(t.data, t.nbytes)
        mine = np.frombuffer(region, dtype={_F32: np.float32, _F16: np.float16, _BF16: np.uint16}[ttype])
        wire_bf16 = comm_wire_type(ttype, count) == _BF16
        out = bf16_bits(mine).tobytes() if wire_bf16 else mine.tobytes()
        try:
            got = comm.link.exchange(out, send_first=comm.rank == 0)
        except (OSError, ConnectionError) as exc:
            raise Close(f"COMM_ALLREDUCE: the peer link failed ({exc}){_upstream('close')}") from None
        t.buffer.written()  # the sum lands in ``mine``, the tensor's own bytes
        if ttype == _F32:
            theirs = bf16_to_f32(np.frombuffer(got, np.uint16)) if wire_bf16 else np.frombuffer(got, np.float32)
            np.add(mine, theirs, out=mine)
        elif ttype == _F16:
            np.add(mine, np.frombuffer(got, np.float16), out=mine)
        else:
            total = bf16_to_f32(mine) + bf16_to_f32(np.frombuffer(got, np.uint16))
            mine[:] = bf16_bits(total)

    def free(self, f: dict[str, Any]) -> None:
        device = self.resolve.device(f["device"], "COMM_FREE")
        comm = self.comms.pop(device, None)
        if comm is not None:
            comm.close()

    def release(self) -> None:
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()


__all__ = ["CommCommands", "Communicator", "Link", "Links", "bf16_bits", "bf16_to_f32"]
