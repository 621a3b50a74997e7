"""Judging a target's reply against the model's (a mixin of :class:`.example.Example`): the size header first,
then the payload -- data read back (wrong bytes, or an info leak where the model holds zeros), allocations, bases,
and every other reply exactly (server-specific values only against the embedded reference)."""

from __future__ import annotations

import numpy as np
from ggml_rpc.conformance.checks._leaks import classify
from ggml_rpc.conformance.sessions.compare import RECORDED_ONLY
from ggml_rpc.spec import Command
from ggml_rpc.spec.codec import REPLY_HEADER_SIZE
from ggml_rpc.spec.layout import flat_layout

from .channel import TargetConnection
from .message import FuzzMessage


class ReplyChecks:
    """The comparisons; ``self`` is an :class:`.example.Example`."""

    def _check_reply(self, msg: FuzzMessage, want: bytes, tconn: TargetConnection) -> None:
        head = tconn.read(REPLY_HEADER_SIZE)
        if head.timed_out:
            self._fail("hang", f"no reply {head.waited(self.host.timeout)}", msg)
        if len(head.data) < REPLY_HEADER_SIZE:
            self._closed_unexpectedly(msg, "replies")
        want_head, want_body = want[:REPLY_HEADER_SIZE], want[REPLY_HEADER_SIZE:]
        if head.data != want_head:
            got = int.from_bytes(head.data, "little")
            self._end_target()
            self._fail("wrong-reply", f"reply size {got}, the reference replies {len(want_body)} bytes", msg)
        body = tconn.read(len(want_body))
        if body.timed_out:
            self._fail("hang", "reply body incomplete " + ("(the target waits for more input)" if body.idle else
                                                           f"after {self.host.timeout:g} s"), msg)
        if len(body.data) < len(want_body):
            self._closed_unexpectedly(msg, "replies")
        self._compare(msg, want_body, body.data)

    def _compare(self, msg: FuzzMessage, want: bytes, got: bytes) -> None:
        verdict = self.shadow.judge(msg, got) if self.shadow is not None else None
        if verdict is not None:  # one of the shadow-memory oracle's reads: judged over the bytes the shadow knows
            if verdict.message:
                self._fail("corruption", verdict.message, verdict.write, symptom=verdict.symptom)
            return
        cmd = msg.command
        spec = self.protocol.commands[cmd]
        schema = spec.reply.schema  # type: ignore[union-attr]
        if cmd is Command.GET_TENSOR:
            if want != got and (self.host.exact or not self.computed):
                w, g = np.frombuffer(want, np.uint8), np.frombuffer(got, np.uint8)
                differ = w != g
                if not w[differ].any():
                    # Every differing byte is one the reference holds as zero (never written: fresh buffers are
                    # zeroed): the target handed out memory of its own.
                    report = classify(got)
                    self._fail("info-leak", f"GET_TENSOR returned {int(differ.sum())} of {len(want)} byte(s) the "
                               f"server was never given ({report.describe()})", msg,
                               symptom=report.symptom if report.leaked else "stale-bytes")
                at = int(np.flatnonzero(differ)[0])
                self._fail("wrong-reply", f"data read back differs from the reference at byte {at} of {len(want)} "
                           f"({got[at:at + 8].hex(' ')} instead of {want[at:at + 8].hex(' ')})", msg)
            return
        w = flat_layout(schema).unpack(want)
        g = flat_layout(schema).unpack(got)
        if cmd is Command.ALLOC_BUFFER:
            self._compare_alloc(msg, w, g)
            self.reloc.buffer(w["remote_ptr"], g["remote_ptr"])
            if g["remote_ptr"]:
                self._target_live.add(g["remote_ptr"])
            return
        if cmd is Command.BUFFER_GET_BASE:
            if bool(w["base_ptr"]) != bool(g["base_ptr"]):
                self._fail("wrong-reply", f"base {g['base_ptr']:#x}, the reference {w['base_ptr']:#x}", msg)
            self.reloc.base(msg.fields["remote_ptr"], w["base_ptr"], g["base_ptr"])
            return
        if cmd in RECORDED_ONLY and not self.host.exact:
            return
        if cmd is Command.SET_TENSOR_HASH and self.host.cache_unknown and g.get("result") and not w.get("result"):
            # A hit the model cannot know of (the target's cache holds entries from before this example): the
            # tensor now holds bytes the model never saw, so nothing more of this example can be judged.
            self.untracked = True
            return
        if w != g:
            self._fail("wrong-reply", f"reply {g}, the reference replies {w}", msg)

    def _compare_alloc(self, msg: FuzzMessage, want: dict, got: dict) -> None:
        """Same success and size as the model's, unless the model cannot know the target's memory.

        The model's budget is the target's announced total (or, against the embedded reference, its very
        configuration).  A server other than the embedded reference may still grant more than the model does (it
        need not enforce what it announces): that is its own business, but from then on it holds memory the
        model never granted, so a later refusal is no finding and the rest of the example is not judged.
        """
        granted, model_granted = bool(got["remote_ptr"]), bool(want["remote_ptr"])
        if granted == model_granted:
            if granted and want["remote_size"] != got["remote_size"]:
                self._fail("wrong-reply", f"allocation {got}, the reference {want}", msg)
            return
        if not self.host.exact:
            if granted and msg.fields.get("size", 0) > self.host.model_config.device.memory:
                self.memory_diverged = True
                return
            if not granted and self.memory_diverged:
                self.untracked = True
                return
        self._fail("wrong-reply", f"allocation {got}, the reference {want}", msg)


__all__ = ["ReplyChecks"]
