"""The shadow-memory oracle in a fuzz example.

:class:`ExampleShadow` keeps one :class:`~ggml_rpc.conformance.harness.shadow.ShadowMemory` per connection of the
example, over that connection's model (the reference core the example feeds every message). After every command
that may write and that the model ran without closing, it reads back what the command must not have touched --
the destination's buffer, its neighbours by the target's addresses, other buffers, bounded bytes per step, large
buffers sampled -- through the example (model and target alike, so a reproducer replays the reads), and judges the
target's bytes against the shadow. A difference is a finding of its own kind, ``corruption``, blamed on the write
(not on the read that saw it), named by the write's command, its tensor's geometry (``spec.geometry`` classes) and
where the bytes changed. The oracle judges and says; the example raises the finding (:meth:`ExampleShadow.judge`
returns a :class:`Verdict`), so the oracle holds no reference to the example's class, only to what
:class:`Shadowed` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ggml_rpc.conformance.harness.shadow import WRITES, Read, ShadowMemory, destination, written_tensor
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.spec import Command, GgmlType, make_tensor
from ggml_rpc.spec import Protocol as WireProtocol
from ggml_rpc.spec.geometry import Geometry, Span, classify

from .message import FuzzMessage
from .valid_requests import ConnRef

#: Tag of the messages that fill a buffer with canaries (the oracle learns from them and reads nothing after them;
#: a shrinker keeps them: without them a read returns the target's own fresh memory).
CANARY_TAG = "canary"
#: Tag of the oracle's reads.
READ_TAG = "shadow-read"


class Shadowed(Protocol):
    """What the oracle uses of an example: its connections' models, the open one, the relocation of handles and
    addresses to the target's, and ``send`` (model and target alike, replies judged)."""

    protocol: WireProtocol
    models: Mapping[ConnRef, Any]
    current: ConnRef | None
    reloc: Relocator

    @property
    def inert(self) -> bool: ...

    def send(self, ref: ConnRef, msg: FuzzMessage) -> bytes | None: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """The oracle's judgement of one of its reads: a corruption (``message`` not empty) blamed on ``write``."""

    write: FuzzMessage
    message: str = ""
    symptom: str = ""


class ExampleShadow:
    """The oracle of one example (see the module's doc)."""

    def __init__(self, ex: Shadowed, *, exact: bool, alignment: int) -> None:
        self.ex = ex
        #: The target is the reference itself (computed bytes judged bit for bit); the server's alignment.
        self.exact, self.alignment = exact, alignment
        self._mems: dict[int, tuple[Any, ShadowMemory]] = {}
        #: Reads sent and not yet judged: id of the read message -> (read, the write it follows, the memory).
        self._pending: dict[int, tuple[Read, FuzzMessage, ShadowMemory]] = {}
        #: Geometry notes of messages a strategy drew (id of the message -> its geometry).
        self._geometry: dict[int, Geometry] = {}
        self.reads = 0
        self.judged = 0

    # ---- per connection ------------------------------------------------------------------------------------

    def memory(self, ref: ConnRef) -> ShadowMemory | None:
        """The shadow of ``ref``'s current incarnation (a new one when its model changed), None when closed."""
        model = self.ex.models.get(ref)
        if model is None or model.closed:
            return None
        entry = self._mems.get(ref.index)
        if entry is None or entry[0] is not model:
            mem = ShadowMemory(model.buffers, exact=self.exact, seed=ref.index * 7919 + ref.incarnation)
            self._mems[ref.index] = (model, mem)
            return mem
        return entry[1]

    def note(self, msg: FuzzMessage, geometry: Geometry) -> None:
        """``msg``'s tensor was drawn as ``geometry`` (named in a finding)."""
        self._geometry[id(msg)] = geometry

    # ---- after a write ------------------------------------------------------------------------------------

    def after(self, ref: ConnRef, msg: FuzzMessage) -> None:
        """The model ran ``msg`` (a write) without closing: learn what it wrote, then read back and judge."""
        if msg.command not in WRITES:
            return
        mem = self.memory(ref)
        if mem is None:
            return
        mem.after(msg.command, msg.fields)
        if CANARY_TAG in msg.tags:
            return
        ex = self.ex
        two_d = Command.GET_TENSOR_2D in ex.protocol.commands
        for read in mem.plan(order=self._target_order(mem), two_d=two_d, readable=ex.reloc.bases):
            if ex.inert or ex.current is not ref or self.memory(ref) is not mem:
                return
            probe = self._read_message(mem, read)
            self._pending[id(probe)] = (read, msg, mem)
            try:
                ex.send(ref, probe)
            finally:
                self._pending.pop(id(probe), None)
            self.reads += 1

    def _target_order(self, mem: ShadowMemory) -> list[int]:
        """Tracked model handles sorted by the target's base address of each (those the relocator knows)."""
        bases = self.ex.reloc.bases
        known = [(bases[h][1], h) for h in mem.tracked if h in bases]
        return [h for _, h in sorted(known)]

    def _read_message(self, mem: ShadowMemory, read: Read) -> FuzzMessage:
        t = mem.tracked[read.handle]
        whole = make_tensor(id=0x5AD0_0000 + t.number, type=int(GgmlType.I8), ne=(t.size,), buffer=t.handle,
                            data=t.base)
        if read.copies > 1:
            return FuzzMessage(Command.GET_TENSOR_2D, {"tensor": whole, "offset": read.offset, "size": read.size,
                                                       "n_copies": read.copies, "stride": read.stride},
                               tags=(READ_TAG,))
        return FuzzMessage(Command.GET_TENSOR, {"tensor": whole, "offset": read.offset, "size": read.size},
                           tags=(READ_TAG,))

    # ---- judging ------------------------------------------------------------------------------------------

    def judge(self, probe: FuzzMessage, got: bytes) -> Verdict | None:
        """Judge the target's reply to one of the oracle's reads (None: ``probe`` is not one)."""
        entry = self._pending.get(id(probe))
        if entry is None:
            return None
        read, write, mem = entry
        self.judged += 1
        corruption = mem.judge(read, got, destination=destination(write.command, write.fields, mem.buffers))
        if corruption is None:
            return Verdict(write)
        geometry = self.geometry_of(write, mem)
        # One class per place (and view) of the written tensor: the shape is named in the message, not the class.
        place = "/".join(p for p in (geometry.place, geometry.view) if p) if geometry is not None else "no tensor"
        shown = f" of {geometry.describe()}" if geometry is not None else ""
        return Verdict(write, f"after {write.describe()}{shown}: {corruption.describe()}",
                       f"{corruption.where or 'a buffer'}; {place}")

    def geometry_of(self, msg: FuzzMessage, mem: ShadowMemory) -> Geometry | None:
        """The geometry of ``msg``'s written tensor: as drawn, or classified from its fields."""
        drawn = self._geometry.get(id(msg))
        if drawn is not None:
            return drawn
        t = written_tensor(msg.command, msg.fields)
        if t is None:
            return None
        buf = mem.buffers.get(int(t["buffer"])) if t.get("buffer") else None
        span = Span(int(t["buffer"]), buf.base, buf.size) if buf is not None else None
        return classify(t, span, alignment=self.alignment)


__all__ = ["CANARY_TAG", "READ_TAG", "ExampleShadow", "Shadowed", "Verdict"]
