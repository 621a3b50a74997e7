"""The stateful fuzzer: a hypothesis ``RuleBasedStateMachine`` built from a version's command table.

Bundles hold connections, buffers and tensors; there is one rule per command of the table (a valid request,
sometimes with exactly one rule broken), plus rules that open and end connections, allocate buffers, place tensors,
break the handshake and send command ids the version does not have.  The oracle is the reference server's own
connection logic (:mod:`.model`); the invariants are checked by :class:`.example.Example` after every message and
at the end of every example.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ggml_rpc.spec import NEVER_ON_WIRE, Command, Protocol
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, multiple, rule

from .generate import ALLOC_SIZES, BufferRef, ConnRef, TensorRef, needs_state, placed_tensor, valid_request
from .message import FuzzMessage
from .nearvalid import break_one

if TYPE_CHECKING:
    from .campaign import Campaign

#: Out of ten messages, how many break one rule (the rest are valid requests).
BROKEN_PER_TEN = 1
#: Commands that change tensor data: the written tensor is read back after each (data must equal the model's).
WRITES = frozenset({Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR, Command.SET_TENSOR_HASH,
                    Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE, Command.BUFFER_CLEAR})
#: A command that only makes sense after another one on the same connection (state, not layout).
PREREQUISITES = {Command.GRAPH_RECOMPUTE: Command.GRAPH_COMPUTE}


def unknown_commands(protocol: Protocol) -> list[int]:
    """Command bytes a server of ``protocol`` must close on: sentinels, ids past the table, the top byte."""
    count = protocol.command_count
    return sorted({*(int(c) for c in NEVER_ON_WIRE), count, count + 1, 0xFF} - {int(c) for c in protocol.commands})


def build_machine(campaign: Campaign) -> type[RuleBasedStateMachine]:
    """A state machine class for the campaign's protocol (one rule per command of its table)."""
    protocol = campaign.protocol
    devices = st.integers(0, max(0, campaign.devices - 1))
    bad_ids = unknown_commands(protocol)
    reqs = [c for c in protocol.commands if c is not Command.HELLO]

    class FuzzMachine(RuleBasedStateMachine):
        connections = Bundle("connections")
        buffers = Bundle("buffers")
        tensors = Bundle("tensors")

        def __init__(self) -> None:
            super().__init__()
            self.ex = campaign.new_example()

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

        @rule(target=buffers, size=ALLOC_SIZES, device=devices)
        def alloc_buffer(self, size: int, device: int) -> Any:
            buf = self.ex.alloc(self.ex.active(), size, device)
            return buf if buf is not None else multiple()

        @rule(target=tensors, buf=buffers, data=st.data())
        def place_tensor(self, buf: BufferRef, data: st.DataObject) -> TensorRef:
            t = data.draw(placed_tensor(self.ex.scope, buf))
            self.ex.scope.all_tensors.append(t)
            return t

        @rule(how=st.sampled_from(("handshake", "unknown command", "hello again")), data=st.data())
        def break_connection(self, how: str, data: st.DataObject) -> None:
            """Break the connection itself: a bad first message, a command id the version lacks, a second HELLO."""
            ex = self.ex
            conn = ex.active()
            hello = FuzzMessage(Command.HELLO, {"conn_caps": bytes(24)})
            if how == "handshake":
                other = data.draw(st.sampled_from(reqs))
                first = data.draw(st.one_of(break_one(ex.scope, hello, protocol), valid_request(ex.scope, other)))
                if first.command is not Command.HELLO:
                    first.broken = f"id: {first.command.name} before HELLO"
                ex.open(conn, first)
                return
            ex.prepare(conn)
            if how == "hello again":
                hello.broken = "id: HELLO after the handshake"
                ex.send(conn, hello)
                return
            cmd = data.draw(st.sampled_from(bad_ids))
            msg = data.draw(valid_request(ex.scope, data.draw(st.sampled_from(reqs))))
            msg.wire_command = cmd
            msg.broken = f"id: command byte {cmd}"
            ex.send(conn, msg)

        def _setup(self, conn: ConnRef, data: st.DataObject) -> None:
            ex = self.ex
            buf = ex.alloc(conn, data.draw(st.integers(64, 4096)), data.draw(devices))
            if buf is not None:
                first = data.draw(placed_tensor(ex.scope, buf))
                ex.scope.all_tensors.append(first)
                # A second tensor of the same type and shape, so that a graph can combine the two.
                ex.scope.all_tensors.append(data.draw(placed_tensor(ex.scope, buf, like=first)))
            ex.prepare(conn)

        def teardown(self) -> None:
            self.ex.finish()

    def command_rule(command: Command):
        payload = protocol.commands[command].request
        stateful = needs_state(payload)
        before = PREREQUISITES.get(command)

        def send(self: FuzzMachine, data: st.DataObject) -> None:
            ex = self.ex
            conn = ex.active()
            if stateful and not ex.scope.tensors:
                # Nothing to refer to yet on this connection: make a buffer and a tensor first.
                self._setup(conn, data)
            if before is not None and not ex.has_graph(conn):
                ex.send(conn, data.draw(valid_request(ex.scope, before)))
                ex.prepare(conn)
            msg = data.draw(valid_request(ex.scope, command))
            if data.draw(st.integers(0, 9)) >= 10 - BROKEN_PER_TEN:
                msg = data.draw(break_one(ex.scope, msg, protocol))
            ex.send(conn, msg)
            if msg.broken is None and command in WRITES:
                ex.read_back(conn, msg)

        send.__name__ = f"send_{command.name.lower()}"
        return rule(data=st.data())(send)

    for command in reqs:
        setattr(FuzzMachine, f"send_{command.name.lower()}", command_rule(command))
    FuzzMachine.__name__ = f"FuzzMachine_v{protocol.label.replace('.', '_')}"
    return FuzzMachine
