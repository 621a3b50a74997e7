"""Judging a target's reply payload against the model's: data read back (wrong bytes, or an info leak where the
model holds zeros), allocations, bases, and every other reply exactly (server-specific values only against the
embedded reference).

Rules of this module:

1. The judge reads payloads, never sockets: :class:`~.example.Example` reads the reply off the connection (its size
   header first, a death or a hang on the way) and hands the judge the payload it got beside the model's.
2. The judge says what it found, it does not raise: a :class:`Mismatch` (the finding's kind, message and symptom),
   or None; the example turns a mismatch into its finding.
3. From the replies it judges the judge learns the target's side of the relocation (handles and bases, into the
   example's :class:`~ggml_rpc.conformance.sessions.relocate.Relocator`) and which handles are live on the open
   connection; and it knows when the model no longer knows the target's state (:attr:`ReplyJudge.untracked`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from ggml_rpc.conformance.checks._leaks import classify
from ggml_rpc.conformance.sessions.compare import RECORDED_ONLY
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.spec import Command
from ggml_rpc.spec import Protocol as WireProtocol
from ggml_rpc.spec.layout import flat_layout

from .host import ExampleHost
from .message import FuzzMessage


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A reply the target should not have sent: the finding's kind, its message, and (for a leak) what it looked
    like."""

    kind: str
    message: str
    symptom: str = ""


def _handles(fields: dict) -> list[int]:
    """Every buffer handle a request names (``remote_ptr``, and the ``buffer`` of each tensor it carries)."""
    out = [fields["remote_ptr"]] if isinstance(fields.get("remote_ptr"), int) else []
    for key in ("tensor", "src", "dst", "op"):
        t = fields.get(key)
        if isinstance(t, dict):
            out.append(int(t["buffer"]))
    for t in fields.get("srcs", ()) or ():
        if isinstance(t, dict):
            out.append(int(t["buffer"]))
    tensors = fields.get("tensors")
    if isinstance(tensors, np.ndarray):
        out += [int(b) for b in np.unique(tensors["buffer"])]
    elif tensors:
        out += [int(t["buffer"]) for t in tensors]
    return out


class ReplyJudge:
    """The judge of one example's replies (an :class:`~.example.Example` holds one)."""

    def __init__(self, host: ExampleHost, protocol: WireProtocol, reloc: Relocator) -> None:
        self.host = host
        self.protocol = protocol
        self.reloc = reloc
        #: The target granted an allocation beyond the model's budget: it holds memory the model does not know of.
        self.memory_diverged = False
        #: The model no longer knows the target's state (a refusal after ``memory_diverged``, a hash hit the model
        #: cannot know of, or a stale handle the target has since handed out again): judge nothing more.
        self.untracked = False
        #: Target buffer handles live on the open connection (a server may reuse a freed buffer's address as the
        #: handle of a new one: a stale model handle relocated to it names a live buffer, which is no finding).
        self._target_live: set[int] = set()

    def new_connection(self) -> None:
        """A new connection to the target: no handle is live on it yet."""
        self._target_live = set()

    def freed(self, model_handle: int) -> None:
        """The model freed ``model_handle`` on the open connection (FREE_BUFFER answered by no close)."""
        self._target_live.discard(self.reloc.handle(model_handle))

    def names_reused_handle(self, model_live: Collection[int], msg: FuzzMessage) -> bool:
        """Does ``msg`` name a handle the model does not know on this connection (``model_live``: the model's live
        handles), which relocates to a buffer the target has live here (its old owner freed it, and the target gave
        the same value to a new buffer)?  Then nothing more of the example can be judged."""
        if not self._target_live:
            return False
        for handle in _handles(msg.fields):
            if handle and handle not in model_live and self.reloc.handle(handle) in self._target_live:
                self.untracked = True
                return True
        return False

    def payload(self, msg: FuzzMessage, want: bytes, got: bytes, *, computed: bool) -> Mismatch | None:
        """Judge the target's reply payload ``got`` to ``msg`` against the model's ``want`` (``computed``: a graph
        was computed on this connection, so data read back may differ within the executors' rounding)."""
        cmd = msg.command
        spec = self.protocol.commands[cmd]
        schema = spec.reply.schema  # type: ignore[union-attr]
        if cmd is Command.GET_TENSOR:
            if want != got and (self.host.exact or not computed):
                w, g = np.frombuffer(want, np.uint8), np.frombuffer(got, np.uint8)
                differ = w != g
                if not w[differ].any():
                    # Every differing byte is one the reference holds as zero (never written: fresh buffers are
                    # zeroed): the target handed out memory of its own.
                    report = classify(got)
                    return Mismatch("info-leak", f"GET_TENSOR returned {int(differ.sum())} of {len(want)} byte(s) "
                                    f"the server was never given ({report.describe()})",
                                    report.symptom if report.leaked else "stale-bytes")
                at = int(np.flatnonzero(differ)[0])
                return Mismatch("wrong-reply", f"data read back differs from the reference at byte {at} of "
                                f"{len(want)} ({got[at:at + 8].hex(' ')} instead of {want[at:at + 8].hex(' ')})")
            return None
        w = flat_layout(schema).unpack(want)
        g = flat_layout(schema).unpack(got)
        if cmd is Command.ALLOC_BUFFER:
            wrong = self._alloc(msg, w, g)
            if wrong is not None:
                return wrong
            self.reloc.buffer(w["remote_ptr"], g["remote_ptr"])
            if g["remote_ptr"]:
                self._target_live.add(g["remote_ptr"])
            return None
        if cmd is Command.BUFFER_GET_BASE:
            if bool(w["base_ptr"]) != bool(g["base_ptr"]):
                return Mismatch("wrong-reply", f"base {g['base_ptr']:#x}, the reference {w['base_ptr']:#x}")
            self.reloc.base(msg.fields["remote_ptr"], w["base_ptr"], g["base_ptr"])
            return None
        if cmd in RECORDED_ONLY and not self.host.exact:
            return None
        if cmd is Command.SET_TENSOR_HASH and self.host.cache_unknown and g.get("result") and not w.get("result"):
            # A hit the model cannot know of (the target's cache holds entries from before this example): the
            # tensor now holds bytes the model never saw, so nothing more of this example can be judged.
            self.untracked = True
            return None
        if w != g:
            return Mismatch("wrong-reply", f"reply {g}, the reference replies {w}")
        return None

    def _alloc(self, msg: FuzzMessage, want: dict, got: dict) -> Mismatch | None:
        """Same success and size as the model's, unless the model cannot know the target's memory.

        The model's budget is the target's announced total (or, against the embedded reference, its very
        configuration).  A server other than the embedded reference may still grant more than the model does (it
        need not enforce what it announces): that is its own business, but from then on it holds memory the
        model never granted, so a later refusal is no finding and the rest of the example is not judged.
        """
        granted, model_granted = bool(got["remote_ptr"]), bool(want["remote_ptr"])
        if granted == model_granted:
            if granted and want["remote_size"] != got["remote_size"]:
                return Mismatch("wrong-reply", f"allocation {got}, the reference {want}")
            return None
        if not self.host.exact:
            if granted and msg.fields.get("size", 0) > self.host.model_config.device.memory:
                self.memory_diverged = True
                return None
            if not granted and self.memory_diverged:
                self.untracked = True
                return None
        return Mismatch("wrong-reply", f"allocation {got}, the reference {want}")


__all__ = ["Mismatch", "ReplyJudge"]
