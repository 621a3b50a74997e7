"""The stateful fuzzer: a hypothesis ``RuleBasedStateMachine`` built from a version's command table.

Bundles hold connections, buffers and tensors; there is one rule per command of the table (a valid request,
sometimes with exactly one rule broken), plus rules that open and revisit connections, allocate buffers, place
tensors, and break the connection itself (a bad handshake, a command id the version lacks, a second HELLO).

Each command rule's request is drawn choice by choice through hypothesis; a burst of further steps follows it,
made by the same generators from a seed hypothesis draws (:mod:`.draws`): hypothesis shrinks the burst's length
and seed, and the burst keeps the campaign's message rate far above what per-field draws allow.

The oracle is the reference server's own connection logic (:mod:`.oracle`); the invariants are checked by
:class:`.example.Example` after every message and at the end of every example.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from ggml_rpc.spec import Command
from ggml_rpc.spec import Protocol as WireProtocol
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

from .draws import HypothesisDraw
from .example import Example
from .steps import break_connection, burst, command_step
from .valid_requests import BufferRef, ConnRef, TensorRef, alloc_size, placed_tensors

#: Longest burst of seeded steps after a rule's own request.
BURST_MAX = 48


class OutOfTime(BaseException):
    """The campaign's time budget is spent: raised between two steps, it ends the hypothesis round at once (not an
    ``Exception``: hypothesis lets it through, as it does an interrupt, instead of shrinking it as a failure)."""


class ExampleSource(Protocol):
    """What the machine needs of the campaign that runs it (:class:`.campaign.Campaign`)."""

    protocol: WireProtocol
    devices: int

    def new_example(self) -> Example:
        """The example a new hypothesis example drives (the campaign checks its budget and target first)."""
        ...

    def past_deadline(self) -> bool:
        """The campaign's time budget is spent (the round must end now)."""
        ...


def build_machine(campaign: ExampleSource) -> type[RuleBasedStateMachine]:
    """A state machine class for the campaign's protocol (one rule per command of its table)."""
    protocol = campaign.protocol
    devices = st.integers(0, max(0, campaign.devices - 1))
    bursts = st.integers(0, BURST_MAX)
    seeds = st.integers(0, (1 << 32) - 1)

    class FuzzMachine(RuleBasedStateMachine):
        connections = Bundle("connections")
        buffers = Bundle("buffers")
        tensors = Bundle("tensors")

        def __init__(self) -> None:
            super().__init__()
            self.ex = campaign.new_example()

        def _burst(self, n: int, seed: int) -> None:
            if n:
                burst(self.ex, random.Random(seed), n)

        @initialize(target=connections)
        def first_connection(self) -> ConnRef:
            ref = self.ex.new_ref()
            self.ex.prepare(ref)
            return ref

        @rule(target=connections, close_first=st.booleans())
        def another_connection(self, close_first: bool) -> ConnRef:
            """A new connection (the current one is ended first, or simply left behind and closed then)."""
            if close_first:
                self.ex.close_current()
            ref = self.ex.new_ref()
            self.ex.prepare(ref)
            return ref

        @rule(conn=connections)
        def switch_connection(self, conn: ConnRef) -> None:
            """Go back to an earlier connection (re-opened if it ended: its old buffers are then stale)."""
            self.ex.prepare(conn)

        @rule(target=buffers, data=st.data(), device=devices)
        def alloc_buffer(self, data: st.DataObject, device: int) -> Any:
            buf = self.ex.alloc(self.ex.active(), alloc_size(HypothesisDraw(data.draw)), device)
            return buf if buf is not None else multiple()

        @rule(target=tensors, buf=buffers, data=st.data())
        def place_tensor(self, buf: BufferRef, data: st.DataObject) -> TensorRef:
            t = data.draw(placed_tensors(self.ex.scope, buf))
            self.ex.scope.all_tensors.append(t)
            return t

        @rule(how=st.sampled_from(("handshake", "unknown command", "hello again")), data=st.data())
        def break_connection(self, how: str, data: st.DataObject) -> None:
            """Break the connection itself: a bad first message, a command id the version lacks, a second HELLO."""
            break_connection(self.ex, HypothesisDraw(data.draw), how)

        @invariant()
        def within_budget(self) -> None:
            # Past the time budget the round ends now, instead of running the example's remaining steps as no-ops
            # (with thousands of steps, --steps, that took seconds) and the round's other examples after it.
            if campaign.past_deadline():
                raise OutOfTime

        def teardown(self) -> None:
            self.ex.finish()

    def command_rule(command: Command):
        def send(self: FuzzMachine, data: st.DataObject, n: int, seed: int) -> None:
            command_step(self.ex, HypothesisDraw(data.draw), command)
            self._burst(n, seed)

        send.__name__ = f"send_{command.name.lower()}"
        send.__doc__ = f"A {command.name} request (valid, or with one rule broken), then a seeded burst."
        return rule(data=st.data(), n=bursts, seed=seeds)(send)

    for command in [c for c in protocol.commands if c is not Command.HELLO]:
        setattr(FuzzMachine, f"send_{command.name.lower()}", command_rule(command))
    FuzzMachine.__name__ = f"FuzzMachine_v{protocol.label.replace('.', '_')}"
    return FuzzMachine


__all__ = ["BURST_MAX", "ExampleSource", "OutOfTime", "build_machine"]
