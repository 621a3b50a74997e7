"""Composite steps of a fuzz example: a request with what it needs first, seeded bursts, connection breakage,
read-backs of written tensors.  Each is a function of the :class:`.example.Example` it drives (the state machine's
rules and the hunt call them); every message goes through the example's ``send``, model and target alike."""

from __future__ import annotations

import random

from ggml_rpc.spec import CONN_CAPS_SIZE, Command

from .draws import Draw, RandomDraw
from .example import Example
from .message import FuzzMessage
from .nearvalid import break_one, unknown_commands
from .valid_requests import ConnRef, alloc_size, needs_state, placed_tensor, valid_request

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


def command_step(ex: Example, d: Draw, command: Command) -> None:
    """One request of ``command`` on the active connection: valid, or (one time in ten) with one rule broken.

    A request that needs a buffer or a tensor gets them first; GRAPH_RECOMPUTE gets a graph first; what a valid
    request wrote is read back.
    """
    if ex.inert:
        return
    conn = ex.active()
    payload = ex.protocol.commands[command].request
    if needs_state(payload) and not ex.scope.tensors:
        setup(ex, d, conn)
    before = PREREQUISITES.get(command)
    if before is not None and not ex.has_graph(conn):
        ex.send(conn, valid_request(d, ex.scope, before))
        if not ex.has_graph(conn):
            return  # the prerequisite was refused: the connection is gone, its state with it
    msg = valid_request(d, ex.scope, command)
    if d.integer(0, 9) >= 10 - BROKEN_PER_TEN:
        msg = break_one(d, ex.scope, msg, ex.protocol)
    ex.send(conn, msg)
    if msg.broken is None and command in WRITES:
        read_back(ex, conn, msg)


def setup(ex: Example, d: Draw, conn: ConnRef) -> None:
    """A buffer and two tensors of one type and shape on ``conn`` (so that graphs can combine them)."""
    buf = ex.alloc(conn, d.integer(64, 4096), d.integer(0, max(0, ex.host.devices - 1)))
    if buf is not None:
        first = placed_tensor(d, ex.scope, buf)
        ex.scope.all_tensors.append(first)
        ex.scope.all_tensors.append(placed_tensor(d, ex.scope, buf, like=first))
    ex.prepare(conn)


def burst(ex: Example, rng: random.Random, n: int) -> None:
    """``n`` steps chosen and made from a PRNG: commands of the table, allocations, tensor placements.

    (Connection-level breakage -- handshakes, unknown ids, a second HELLO -- is left to the hypothesis rule: each
    one costs a reconnection, and one rule among the machine's is already their share.)
    """
    d = RandomDraw(rng)
    commands = [c for c in ex.protocol.commands if c is not Command.HELLO]
    for _ in range(n):
        if ex.inert:
            return
        pick = d.integer(0, len(commands) + 1)
        if pick < len(commands):
            command_step(ex, d, commands[pick])
        elif pick == len(commands):
            conn = ex.active()
            ex.alloc(conn, alloc_size(d), d.integer(0, max(0, ex.host.devices - 1)))
        else:
            conn = ex.active()
            if ex.scope.buffers:
                ex.scope.all_tensors.append(placed_tensor(d, ex.scope, d.choice(ex.scope.buffers)))
                ex.prepare(conn)


def break_connection(ex: Example, d: Draw, how: str) -> None:
    """A bad first message, a command id the version lacks, or a second HELLO."""
    if ex.inert:
        return
    reqs = [c for c in ex.protocol.commands if c is not Command.HELLO]
    hello = FuzzMessage(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
    if how == "handshake":
        conn = ex.current or ex.new_ref()
        first = break_one(d, ex.scope, hello, ex.protocol) if d.integer(0, 1) else \
            valid_request(d, ex.scope, d.choice(reqs))
        if first.command is not Command.HELLO:
            first.broken = f"id: {first.command.name} before HELLO"
        ex.open(conn, first)
        return
    conn = ex.active()
    if how == "hello again":
        hello.broken = "id: HELLO after the handshake"
        ex.send(conn, hello)
        return
    msg = valid_request(d, ex.scope, d.choice(reqs))
    msg.wire_command = d.choice(unknown_commands(ex.protocol))
    msg.broken = f"id: command byte {msg.wire_command}"
    ex.send(conn, msg)


def read_back(ex: Example, ref: ConnRef, msg: FuzzMessage) -> None:
    """GET_TENSOR of what ``msg`` wrote (its whole tensor, at most MAX_READ bytes), when it is still there."""
    model = ex.models.get(ref)
    if ex.inert or model is None or model.closed or ref is not ex.current:
        return
    f = msg.fields
    if "dst" in f:
        tensors = [f["dst"]]
    elif "tensor" in f:
        tensors = [f["tensor"]]
    elif "tensors" in f:
        tensors = [t for t in f["tensors"] if t["id"] in set(int(n) for n in f["nodes"])]
    else:  # a whole buffer: every live tensor in it
        tensors = [t.fields for t in ex.scope.tensors if t.buffer.handle == f.get("remote_ptr")]
    live = {t.fields["id"]: t for t in ex.scope.tensors}
    for t in tensors[:2]:
        ref_t = live.get(t["id"])
        if ref_t is None or not ref_t.nbytes or any(ref_t.fields[k] != t[k] for k in _PLACE):
            continue
        size = min(ref_t.nbytes, MAX_READ)
        ex.send(ref, FuzzMessage(Command.GET_TENSOR, {"tensor": ref_t.fields, "offset": 0, "size": size},
                                 tags=("read-back",)))
        if model.closed:
            return


__all__ = ["BROKEN_PER_TEN", "MAX_READ", "PREREQUISITES", "WRITES", "break_connection", "burst", "command_step",
           "read_back", "setup"]
