"""Composite steps of a fuzz example: a request with what it needs first, seeded bursts, connection breakage,
read-backs of written tensors, allocations (a mixin of :class:`.example.Example`, whose ``send`` they go through)."""

from __future__ import annotations

import random

from ggml_rpc.spec import CONN_CAPS_SIZE, Command
from ggml_rpc.spec.layout import flat_layout

from .draws import Draw, RandomDraw
from .message import FuzzMessage
from .nearvalid import break_one, unknown_commands
from .valid_requests import BufferRef, ConnRef, alloc_size, needs_state, placed_tensor, valid_request

#: Out of ten requests, how many break one rule (the rest are valid).
BROKEN_PER_TEN = 1
#: Commands that change tensor data: the written tensor is read back after each (data must equal the model's).
WRITES = frozenset({Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR, Command.SET_TENSOR_HASH,
                    Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE, Command.BUFFER_CLEAR})
#: A command that only makes sense after another one on the same connection (state, not layout).
PREREQUISITES = {Command.GRAPH_RECOMPUTE: Command.GRAPH_COMPUTE}
#: Largest read-back of a written tensor.
MAX_READ = 4096
#: What places a tensor: a read-back uses the known tensor when these fields of the written one match.
_PLACE = ("buffer", "data", "type", "ne", "nb")


class ExampleSteps:
    """The steps; ``self`` is an :class:`.example.Example`."""

    def command_step(self, d: Draw, command: Command) -> None:
        """One request of ``command`` on the active connection: valid, or (one time in ten) with one rule broken.

        A request that needs a buffer or a tensor gets them first; GRAPH_RECOMPUTE gets a graph first; what a valid
        request wrote is read back.
        """
        if self.inert:
            return
        conn = self.active()
        payload = self.protocol.commands[command].request
        if needs_state(payload) and not self.scope.tensors:
            self.setup(d, conn)
        before = PREREQUISITES.get(command)
        if before is not None and not self.has_graph(conn):
            self.send(conn, valid_request(d, self.scope, before))
            if not self.has_graph(conn):
                return  # the prerequisite was refused: the connection is gone, its state with it
        msg = valid_request(d, self.scope, command)
        if d.integer(0, 9) >= 10 - BROKEN_PER_TEN:
            msg = break_one(d, self.scope, msg, self.protocol)
        self.send(conn, msg)
        if msg.broken is None and command in WRITES:
            self.read_back(conn, msg)

    def setup(self, d: Draw, conn: ConnRef) -> None:
        """A buffer and two tensors of one type and shape on ``conn`` (so that graphs can combine them)."""
        buf = self.alloc(conn, d.integer(64, 4096), d.integer(0, max(0, self.host.devices - 1)))
        if buf is not None:
            first = placed_tensor(d, self.scope, buf)
            self.scope.all_tensors.append(first)
            self.scope.all_tensors.append(placed_tensor(d, self.scope, buf, like=first))
        self.prepare(conn)

    def burst(self, rng: random.Random, n: int) -> None:
        """``n`` steps chosen and made from a PRNG: commands of the table, allocations, tensor placements.

        (Connection-level breakage -- handshakes, unknown ids, a second HELLO -- is left to the hypothesis rule: each
        one costs a reconnection, and one rule among the machine's is already their share.)
        """
        d = RandomDraw(rng)
        commands = [c for c in self.protocol.commands if c is not Command.HELLO]
        for _ in range(n):
            if self.inert:
                return
            pick = d.integer(0, len(commands) + 1)
            if pick < len(commands):
                self.command_step(d, commands[pick])
            elif pick == len(commands):
                conn = self.active()
                self.alloc(conn, alloc_size(d), d.integer(0, max(0, self.host.devices - 1)))
            else:
                conn = self.active()
                if self.scope.buffers:
                    self.scope.all_tensors.append(placed_tensor(d, self.scope, d.choice(self.scope.buffers)))
                    self.prepare(conn)

    def break_connection(self, d: Draw, how: str) -> None:
        """A bad first message, a command id the version lacks, or a second HELLO."""
        if self.inert:
            return
        reqs = [c for c in self.protocol.commands if c is not Command.HELLO]
        hello = FuzzMessage(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
        if how == "handshake":
            conn = self.current or self.new_ref()
            first = break_one(d, self.scope, hello, self.protocol) if d.integer(0, 1) else \
                valid_request(d, self.scope, d.choice(reqs))
            if first.command is not Command.HELLO:
                first.broken = f"id: {first.command.name} before HELLO"
            self.open(conn, first)
            return
        conn = self.active()
        if how == "hello again":
            hello.broken = "id: HELLO after the handshake"
            self.send(conn, hello)
            return
        msg = valid_request(d, self.scope, d.choice(reqs))
        msg.wire_command = d.choice(unknown_commands(self.protocol))
        msg.broken = f"id: command byte {msg.wire_command}"
        self.send(conn, msg)

    def read_back(self, ref: ConnRef, msg: FuzzMessage) -> None:
        """GET_TENSOR of what ``msg`` wrote (its whole tensor, at most MAX_READ bytes), when it is still there."""
        model = self.models.get(ref)
        if self.inert or model is None or model.closed or ref is not self.current:
            return
        f = msg.fields
        if "dst" in f:
            tensors = [f["dst"]]
        elif "tensor" in f:
            tensors = [f["tensor"]]
        elif "tensors" in f:
            tensors = [t for t in f["tensors"] if t["id"] in set(int(n) for n in f["nodes"])]
        else:  # a whole buffer: every live tensor in it
            tensors = [t.fields for t in self.scope.tensors if t.buffer.handle == f.get("remote_ptr")]
        live = {t.fields["id"]: t for t in self.scope.tensors}
        for t in tensors[:2]:
            ref_t = live.get(t["id"])
            if ref_t is None or not ref_t.nbytes or any(ref_t.fields[k] != t[k] for k in _PLACE):
                continue
            size = min(ref_t.nbytes, MAX_READ)
            self.send(ref, FuzzMessage(Command.GET_TENSOR, {"tensor": ref_t.fields, "offset": 0, "size": size},
                                       tags=("read-back",)))
            if model.closed:
                return

    def _reply_fields(self, command: Command, payload: bytes) -> dict:
        """A fixed-size reply payload decoded through its derived layout."""
        return flat_layout(self.protocol.commands[command].reply.schema).unpack(payload)  # type: ignore[union-attr]

    def alloc(self, ref: ConnRef, size: int, device: int) -> BufferRef | None:
        """ALLOC_BUFFER then BUFFER_GET_BASE, as a client does; the buffer (model handle and base) or None."""
        reply = self.send(ref, FuzzMessage(Command.ALLOC_BUFFER, {"device": device, "size": size}))
        if not reply:
            return None
        f = self._reply_fields(Command.ALLOC_BUFFER, reply)
        if not f["remote_ptr"]:
            return None
        base_reply = self.send(ref, FuzzMessage(Command.BUFFER_GET_BASE, {"remote_ptr": f["remote_ptr"]}))
        if not base_reply:
            return None
        base = self._reply_fields(Command.BUFFER_GET_BASE, base_reply)["base_ptr"]
        buf = BufferRef(ref, ref.incarnation, f["remote_ptr"], base, f["remote_size"], device)
        self.scope.all_buffers.append(buf)
        return buf

__all__ = ["BROKEN_PER_TEN", "MAX_READ", "PREREQUISITES", "WRITES", "ExampleSteps"]
