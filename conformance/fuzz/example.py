"""One fuzz example: connections to the target, each with its in-process model twin, and the invariants.

Every message goes to the model first (the reference server's own dispatcher, see :mod:`.model`), then to the
target with the target's handles and addresses (learnt from ALLOC_BUFFER / BUFFER_GET_BASE replies, as
``ggml-rpc replay`` relocates them).  Then:

* the model replied: the target must send a reply of the same size; HELLO, data read back, hash hit/miss, copy
  results, allocation success are compared exactly (server-specific values too when the target is the embedded
  reference server, whose configuration the model shares; against another server, the model's budget is the
  memory it announces, and an example stops being judged once the server granted more than that);
* the model closed: the target must close without sending a byte (bytes are a wrong reply, GET_TENSOR data an
  out-of-buffer read; no close within the timeout is a hang);
* the model neither replied nor closed (a no-reply command): nothing may have arrived, and the connection must stay
  open;
* after every unexpected close, and at the end of the example, the target must still accept a connection and
  answer HELLO (otherwise: a crash).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
from ggml_rpc.conformance.checks._leaks import classify
from ggml_rpc.conformance.sessions.compare import RECORDED_ONLY
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, fnv1a64
from ggml_rpc.spec.codec import REPLY_HEADER_SIZE
from ggml_rpc.spec.layout import flat_layout

from .draws import Draw, RandomDraw
from .findings import Finding, Writes
from .generate import BufferRef, ConnRef, Scope, alloc_size, needs_state, placed_tensor, valid_request
from .message import FuzzMessage
from .model import ModelConnection
from .nearvalid import break_one, unknown_commands
from .wire import Refused, TargetConnection

if TYPE_CHECKING:
    from .campaign import Campaign

#: Out of ten requests, how many break one rule (the rest are valid).
BROKEN_PER_TEN = 1
#: Commands that change tensor data: the written tensor is read back after each (data must equal the model's).
WRITES = frozenset({Command.SET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR, Command.SET_TENSOR_HASH,
                    Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE, Command.BUFFER_CLEAR})
#: A command that only makes sense after another one on the same connection (state, not layout).
PREREQUISITES = {Command.GRAPH_RECOMPUTE: Command.GRAPH_COMPUTE}
#: Seconds a target that keeps a connection open where the reference closes gets to close after all.
SLOW_CLOSE = 15.0
#: Largest read-back of a written tensor.
MAX_READ = 4096
#: What places a tensor: a read-back uses the known tensor when these fields of the written one match.
_PLACE = ("buffer", "data", "type", "ne", "nb")

HELLO = FuzzMessage(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})


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


class Example:
    """State of one hypothesis example (a program of connections and messages)."""

    def __init__(self, campaign: Campaign) -> None:
        self.c = campaign
        self.protocol = campaign.protocol
        self.scope = Scope(campaign.protocol, devices=campaign.devices, alignment=campaign.alignment)
        self.models: dict[ConnRef, ModelConnection] = {}
        self.current: ConnRef | None = None
        self.tconn: TargetConnection | None = None
        self.reloc = Relocator()
        self.transcript: list[Writes] = []
        self._writes: Writes = []
        #: The messages behind each connection's client writes, in the same order (what a finding is blamed on).
        self.sent: list[list[FuzzMessage]] = []
        self._sent: list[FuzzMessage] = []
        self.messages = 0
        self.refs = 0
        self.computed = False
        self.finding: Finding | None = None
        self.last: FuzzMessage | None = None
        self._last_ref: ConnRef | None = None
        self._scope_key: tuple | None = None
        self._opening: FuzzMessage | None = None
        #: The target granted an allocation beyond the model's budget: it holds memory the model does not know of.
        self.memory_diverged = False
        #: The model no longer knows the target's state (a refusal after ``memory_diverged``, or a stale handle
        #: the target has since handed out again): judge nothing more.
        self.untracked = False
        #: Target buffer handles live on the open connection (a server may reuse a freed buffer's address as the
        #: handle of a new one: a stale model handle relocated to it names a live buffer, which is no finding).
        self._target_live: set[int] = set()

    # ---- connections -----------------------------------------------------------------------------------------

    def new_ref(self) -> ConnRef:
        self.refs += 1
        return ConnRef(self.refs)

    def _model_open(self, ref: ConnRef) -> bool:
        m = self.models.get(ref)
        return m is not None and not m.closed

    @property
    def inert(self) -> bool:
        """The target is gone, shrinking ran out of time, the budget is spent, a stop was asked for or the model lost
        track of the target's memory: steps send nothing."""
        return (bool(self.c.gone) or self.c.giving_up or self.c.stop_requested or self.c.out_of_budget
                or self.untracked)

    def prepare(self, ref: ConnRef) -> None:
        """Make ``ref`` the open connection (re-opening it when it ended) and point the scope at its state."""
        if self.inert:
            return
        if ref is not self.current or not self._model_open(ref) or self.tconn is None:
            self.open(ref)
        model = self.models[ref]
        live = model.buffers
        s = self.scope
        key = (id(ref), ref.incarnation, len(s.all_buffers), len(s.all_tensors), len(live))
        if key == self._scope_key:
            return  # nothing was allocated, freed or placed since: the live lists still hold
        self._scope_key = key
        s.buffers = [b for b in s.all_buffers if b.conn is ref and b.incarnation == ref.incarnation
                     and b.handle in live]
        handles = {b.handle for b in s.buffers}
        s.tensors = [t for t in s.all_tensors if t.buffer.handle in handles]

    def active(self) -> ConnRef:
        """The connection commands go to: the current one, or the last one used (re-opened), or a first one."""
        ref = self.current or self._last_ref or self.new_ref()
        self.prepare(ref)
        return ref

    def has_graph(self, ref: ConnRef) -> bool:
        """Has the model a stored graph on this connection (GRAPH_RECOMPUTE would run)?"""
        m = self.models.get(ref)
        return m is not None and not m.closed and bool(m.conn.graphs)

    def open(self, ref: ConnRef, first: FuzzMessage = HELLO) -> None:
        """A new connection (new model twin, new TCP connection), starting with ``first`` (normally HELLO)."""
        if self.inert:
            return
        self.close_current()
        ref.incarnation += 1
        try:
            tconn = TargetConnection(self.c.target.host, self.c.target.port, timeout=self.c.timeout)
        except Refused as exc:
            self._fail("crash", f"the target refuses connections ({exc}) after "
                       f"{self.last.describe() if self.last else 'the previous example'}", self.last)
        old = self.models.pop(ref, None)
        if old is not None:
            old.close()
        cache = self.c.model_cache.cache if self.c.model_cache is not None else None
        self.models[ref] = ModelConnection(self.c.model_config, cache, name=f"model {ref!r}")
        self.current, self.tconn = ref, tconn
        self._target_live = set()
        self._last_ref = ref
        self._writes = []
        self.transcript.append(self._writes)
        self._sent = []
        self.sent.append(self._sent)
        self.computed = False
        self._opening = self.last  # what the previous connection sent last (blamed if this opening fails)
        try:
            self.send(ref, first, opening=True)
        finally:
            self._opening = None

    def close_current(self) -> None:
        """End the open connection the way a client leaves: the target must close without a byte."""
        ref, tconn = self.current, self.tconn
        self.current, self.tconn = None, None
        if tconn is None or ref is None:
            return
        model = self.models.get(ref)
        try:
            if model is None or model.closed or tconn.closed:
                return
            model.exchange(b"", end=True)
            tconn.shutdown_write()
            rec = tconn.until_closed()
            if rec.data:
                self._fail("wrong-reply", f"the target sent {len(rec.data)} byte(s) that no request asked for "
                           f"(first: {rec.data[:16].hex(' ')})", self.last)
            if rec.timed_out:
                self._open_where_model_closes(tconn, f"the target did not close within {self.c.timeout:g} s after "
                                              "the client finished sending", self.last)
        finally:
            tconn.close()
            if model is not None:
                model.close()

    def finish(self) -> None:
        """End of the example: close, then the target must still answer a new connection."""
        if self.finding is not None or self.inert:  # failed or stopping: just let go of everything
            if self.tconn is not None:
                self.tconn.close()
            for m in self.models.values():
                m.close()
            return
        try:
            self.close_current()
            if not self.c.alive():
                self._fail("crash", "the target stopped accepting connections after "
                           f"{self.last.describe() if self.last else 'this example'}", self.last)
        finally:
            for m in self.models.values():
                m.close()

    # ---- messages --------------------------------------------------------------------------------------------

    def _relocate(self, fields: dict) -> dict:
        return self.reloc.fields(fields)

    def send(self, ref: ConnRef, msg: FuzzMessage, *, opening: bool = False) -> bytes | None:
        """Send one message on ``ref`` to both sides and check the invariants; the model's reply payload or None."""
        if self.inert:
            return None
        if not opening:
            self.prepare(ref)
        model = self.models[ref]
        tconn = self.tconn
        assert tconn is not None
        if self._reused_handle(model, msg):
            self.untracked = True
            return None
        mbytes, end = msg.encode(self.protocol)
        tbytes = msg.encode(self.protocol, self._relocate)[0] if msg.relocatable else mbytes
        # The target first: it works on the message (another process, another core) while the model does.
        tconn.send(tbytes)
        if end:
            tconn.shutdown_write()
        out = model.exchange(mbytes, end=end)
        self._writes.append((True, mbytes))
        self._sent.append(msg)
        if out.reply:
            self._writes.append((False, out.reply))
        self.messages += 1
        self.last = msg
        self.c.count_message(msg)
        if msg.command is Command.SET_TENSOR and msg.data:
            self.scope.hashes.append(fnv1a64(msg.data))
        if msg.command is Command.FREE_BUFFER and not out.closed:
            self._target_live.discard(self.reloc.handle(msg.fields.get("remote_ptr", 0)))
        if out.reply:
            self._check_reply(msg, out.reply, tconn)
            return out.reply[REPLY_HEADER_SIZE:]
        if out.closed:
            rec = tconn.until_closed()
            if rec.timed_out and not rec.data:
                self._open_where_model_closes(tconn, f"the target neither closed nor answered within "
                                              f"{self.c.timeout:g} s where the reference closes ({out.reason})", msg)
                return None
            self._end_target()
            if rec.data:
                kind = "out-of-buffer" if msg.command is Command.GET_TENSOR and msg.wire_command is None \
                    else "wrong-reply"
                self._fail(kind, f"the target sent {len(rec.data)} byte(s) where the reference closes the "
                           f"connection ({out.reason})", msg)
            return None
        if msg.command in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
            self.computed = True
        rec = tconn.pending()
        if rec.data:
            self._fail("wrong-reply", f"the target sent {len(rec.data)} byte(s) for a command without reply", msg)
        if rec.closed:
            self._end_target()
            self._closed_unexpectedly(msg, "keeps the connection open")
        return None

    def _reused_handle(self, model: ModelConnection, msg: FuzzMessage) -> bool:
        """Does ``msg`` name a handle the model does not know on this connection, which relocates to a buffer the
        target has live here (its old owner freed it, and the target gave the same value to a new buffer)?"""
        if not self._target_live:
            return False
        live = model.buffers
        for handle in _handles(msg.fields):
            if handle and handle not in live and self.reloc.handle(handle) in self._target_live:
                return True
        return False

    def _open_where_model_closes(self, tconn: TargetConnection, message: str, msg: FuzzMessage | None) -> None:
        """The reference closes, the target keeps the connection open in silence: a hang only if the target really
        stopped.  One that still answers a new connection (once this one is gone: a server serving one connection
        at a time queues the next) merely did not close: a wrong reply."""
        if not tconn.closed:
            # A server may first allocate what a size header claims (gigabytes, zeroed) and only then find the
            # stream ended: give it a while longer (bounded) to close before judging.
            tconn.timeout = max(tconn.timeout, SLOW_CLOSE)
            rec = tconn.until_closed()
            tconn.close()
            if rec.closed and not rec.data:
                return
        self._end_target()
        if self.c.alive():
            self._fail("wrong-reply", message + " (the server itself still answers new connections)", msg)
        self._fail("hang", message, msg)

    def record_sent(self, msg: FuzzMessage, wire: bytes) -> None:
        """Count and record a message a strategy sent to the target alone (the model never sees it)."""
        self._writes.append((True, wire))
        self._sent.append(msg)
        self.messages += 1
        self.last = msg
        self.c.count_message(msg)

    def leave_early(self, ref: ConnRef, msg: FuzzMessage) -> None:
        """Send ``msg`` and close the connection at once, reading nothing: the server must outlive a client that
        leaves before its reply (upstream 6/7 die of SIGPIPE writing it).  No reply is recorded: the client never
        read one."""
        if self.inert:
            return
        self.prepare(ref)
        model, tconn = self.models[ref], self.tconn
        assert tconn is not None
        mbytes, _ = msg.encode(self.protocol)
        tbytes, _ = msg.encode(self.protocol, self._relocate)
        tconn.send(tbytes)
        tconn.close()
        model.exchange(mbytes, end=True)
        self._writes.append((True, mbytes))
        self._sent.append(msg)
        self.messages += 1
        self.last = msg
        self.c.count_message(msg)
        self.current, self.tconn = None, None
        model.close()
        if not self.c.alive():
            self._fail("crash", f"the target died after a client closed before reading the reply of {msg.name}",
                       msg)

    def _end_target(self) -> None:
        if self.tconn is not None:
            self.tconn.close()

    def _closed_unexpectedly(self, msg: FuzzMessage, model_did: str) -> None:
        self._end_target()
        if not self.c.alive():
            if self._opening is not None and self._opening is not msg:
                # A dying process may still accept a connection: the death belongs to what came before.
                self._fail("crash", f"the target died after {self._opening.describe()} (it no longer accepts "
                           "connections)", self._opening)
            self._fail("crash", f"the target died on {msg.describe()} (it no longer accepts connections)", msg)
        self._fail("wrong-reply", f"the target closed the connection where the reference {model_did}", msg)

    def _check_reply(self, msg: FuzzMessage, want: bytes, tconn: TargetConnection) -> None:
        head = tconn.read(REPLY_HEADER_SIZE)
        if head.timed_out:
            self._fail("hang", f"no reply within {self.c.timeout:g} s", msg)
        if len(head.data) < REPLY_HEADER_SIZE:
            self._closed_unexpectedly(msg, "replies")
        want_head, want_body = want[:REPLY_HEADER_SIZE], want[REPLY_HEADER_SIZE:]
        if head.data != want_head:
            got = int.from_bytes(head.data, "little")
            self._end_target()
            self._fail("wrong-reply", f"reply size {got}, the reference replies {len(want_body)} bytes", msg)
        body = tconn.read(len(want_body))
        if body.timed_out:
            self._fail("hang", f"reply body incomplete after {self.c.timeout:g} s", msg)
        if len(body.data) < len(want_body):
            self._closed_unexpectedly(msg, "replies")
        self._compare(msg, want_body, body.data)

    def _compare(self, msg: FuzzMessage, want: bytes, got: bytes) -> None:
        cmd = msg.command
        spec = self.protocol.commands[cmd]
        schema = spec.reply.schema  # type: ignore[union-attr]
        if cmd is Command.GET_TENSOR:
            if want != got and (self.c.exact or not self.computed):
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
        if cmd in RECORDED_ONLY and not self.c.exact:
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
        if not self.c.exact:
            if granted and msg.fields.get("size", 0) > self.c.model_config.device.memory:
                self.memory_diverged = True
                return
            if not granted and self.memory_diverged:
                self.untracked = True
                return
        self._fail("wrong-reply", f"allocation {got}, the reference {want}", msg)

    def _fail(self, kind: str, message: str, msg: FuzzMessage | None, symptom: str = "") -> None:
        if kind == "hang" and self.c.target.process_exited():
            kind = "crash"
            message += " (the target process then exited)"
        finding = Finding(kind, message, command=msg.name if msg else "", broken=msg.broken if msg else None)
        finding.symptom = symptom
        self.finding = finding
        if kind in ("crash", "hang"):
            finding.death = self.c.target.death_info()
            self.c.mark_dead()
        self.c.found(self, finding)
        raise finding

    # ---- composite steps ---------------------------------------------------------------------------------------

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
        buf = self.alloc(conn, d.integer(64, 4096), d.integer(0, max(0, self.c.devices - 1)))
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
                self.alloc(conn, alloc_size(d), d.integer(0, max(0, self.c.devices - 1)))
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
