"""One fuzz example: connections to the target, each with its in-process model twin, and the invariants.

Every message goes to the model first (the reference server's own dispatcher, see :mod:`.oracle`), then to the
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

from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.spec import CONN_CAPS_SIZE, Command, fnv1a64
from ggml_rpc.spec.codec import REPLY_HEADER_SIZE
from ggml_rpc.spec.layout import flat_layout

from .channel import Refused, TargetConnection
from .findings import FuzzFinding, Writes
from .host import ExampleHost
from .message import FuzzMessage
from .oracle import ModelConnection
from .reply_checks import ReplyJudge
from .shadow import ExampleShadow
from .valid_requests import BufferRef, ConnRef, Scope

#: Seconds a target that keeps a connection open where the reference closes gets to close after all.
SLOW_CLOSE = 15.0

HELLO = FuzzMessage(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})


class Example:
    """State of one example (a program of connections and messages); its replies are judged by the
    :class:`~.reply_checks.ReplyJudge` it holds, its composite steps are :mod:`.steps`' functions of it."""

    def __init__(self, host: ExampleHost) -> None:
        self.host = host
        self.protocol = host.protocol
        self.scope = Scope(host.protocol, devices=host.devices, alignment=host.alignment)
        self.models: dict[ConnRef, ModelConnection] = {}
        self.current: ConnRef | None = None
        self.tconn: TargetConnection | None = None
        self.reloc = Relocator()
        self.judge = ReplyJudge(host, host.protocol, self.reloc)
        self.transcript: list[Writes] = []
        self._writes: Writes = []
        #: The messages behind each connection's client writes, in the same order (what a finding is blamed on).
        self.sent: list[list[FuzzMessage]] = []
        self._sent: list[FuzzMessage] = []
        self.messages = 0
        #: The target was found dead before this example sent anything of its own (:meth:`dead_before_this_example`).
        self.dead_before = False
        self.refs = 0
        self.computed = False
        self.finding: FuzzFinding | None = None
        self.last: FuzzMessage | None = None
        self._last_ref: ConnRef | None = None
        self._scope_key: tuple | None = None
        self._opening: FuzzMessage | None = None
        #: Sanitizer reports the target had printed before this example (an instrumented server's reports after
        #: it are this example's).
        self._sanitizer_mark = host.target.sanitizer_count
        #: The shadow-memory oracle: reads back after every write what the write must not have touched.
        self.shadow: ExampleShadow | None = ExampleShadow(
            self, exact=host.exact, alignment=host.alignment) if host.shadow else None

    # ---- connections -----------------------------------------------------------------------------------------

    def new_ref(self) -> ConnRef:
        self.refs += 1
        return ConnRef(self.refs)

    def _model_open(self, ref: ConnRef) -> bool:
        m = self.models.get(ref)
        return m is not None and not m.closed

    @property
    def memory_diverged(self) -> bool:
        """The target granted an allocation beyond the model's budget (see :attr:`.ReplyJudge.memory_diverged`)."""
        return self.judge.memory_diverged

    @property
    def untracked(self) -> bool:
        """The model no longer knows the target's state: judge nothing more (see :attr:`.ReplyJudge.untracked`)."""
        return self.judge.untracked

    @property
    def inert(self) -> bool:
        """The target is gone, shrinking ran out of time, the budget is spent, a stop was asked for or the model lost
        track of the target's memory: steps send nothing."""
        return self.host.examples_inert or self.untracked

    def prepare(self, ref: ConnRef) -> None:
        """Make ``ref`` the open connection (re-opening it when it ended) and point the scope at its state."""
        if self.inert:
            return
        if ref is not self.current or not self._model_open(ref) or self.tconn is None:
            self.open(ref)
            if self.dead_before:  # the target was dead before this example (see dead_before_this_example)
                return
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
        return m is not None and not m.closed and bool(m.core.graphs)

    def open(self, ref: ConnRef, first: FuzzMessage = HELLO) -> None:
        """A new connection (new model twin, new TCP connection), starting with ``first`` (normally HELLO)."""
        if self.inert:
            return
        self.close_current()
        ref.incarnation += 1
        try:
            # A target that can say it waits for input ends a wait for a reply or a close as soon as it does.
            tconn = TargetConnection(self.host.target.host, self.host.target.port, timeout=self.host.timeout,
                                     idle=self.host.target.waiting_for_input)
        except Refused as exc:
            if self.messages == 0:
                self.dead_before_this_example()
                return
            self._fail("crash", f"the target refuses connections ({exc}) after "
                       f"{self.last.describe() if self.last else 'the previous example'}", self.last)
        old = self.models.pop(ref, None)
        if old is not None:
            old.close()
        cache = self.host.model_cache.cache if self.host.model_cache is not None else None
        # Handles and bases from the campaign's seed and this connection's place in the example: an example run
        # again (a shrink, a replay of its choices) meets the same model (hypothesis requires it).
        addresses = random.Random(f"ggml-rpc-fuzz-model:{self.host.seed}:{len(self.transcript)}")
        self.models[ref] = ModelConnection(self.host.model_config, cache, name=f"model {ref!r}", addresses=addresses)
        self.current, self.tconn = ref, tconn
        self.judge.new_connection()
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
        if len(self.transcript) == 1 and first.command is Command.HELLO and self.tconn is not None \
                and self.finding is None:
            # The cache was emptied before this example, but a server that serves one connection at a time may
            # still have been finishing the previous example's (a request without a reply, left queued when that
            # example stopped at a failure): a cache file written then would answer this example's SET_TENSOR_HASH
            # as a hit the model cannot know of, and the reproducer would not fail a fresh server. Its HELLO reply
            # means it has moved on to this connection: emptied again now.
            self.host.clear_target_cache()

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
                self._open_where_model_closes(tconn, f"the target did not close {rec.waited(self.host.timeout)} after "
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
            if self.finding is not None and self.finding.kind != "crash" and not self.inert:
                # A server that dies of the close (a heap it corrupted, freed with the connection's buffers) is
                # seen now: the next example starts on a fresh one instead of blaming its own HELLO.
                self.host.alive()
            return
        try:
            self.close_current()
            if not self.host.alive():
                self._fail("crash", "the target stopped accepting connections after "
                           f"{self.last.describe() if self.last else 'this example'}", self.last)
            self._check_sanitizer(self.last, settle=True)
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
        if self.judge.names_reused_handle(model.buffers, msg):
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
        self.host.count_message(msg)
        if msg.command is Command.SET_TENSOR and msg.data:
            self.scope.hashes.append(fnv1a64(msg.data))
        if msg.command is Command.FREE_BUFFER and not out.closed:
            self.judge.freed(msg.fields.get("remote_ptr", 0))
        if out.reply:
            self._check_reply(msg, out.reply, tconn)
            if self.dead_before:  # the target was dead before this example: nothing more of it
                return None
            self._check_sanitizer(msg)
            if self.shadow is not None and not out.closed:
                self.shadow.after(ref, msg)
            return out.reply[REPLY_HEADER_SIZE:]
        if out.closed:
            rec = tconn.until_closed()
            if rec.timed_out and not rec.data:
                self._open_where_model_closes(tconn, f"the target neither closed nor answered "
                                              f"{rec.waited(self.host.timeout)} where the reference closes "
                                              f"({out.reason})", msg)
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
        if self.shadow is not None:
            self.shadow.after(ref, msg)
        return None

    def _check_reply(self, msg: FuzzMessage, want: bytes, tconn: TargetConnection) -> None:
        """Read the target's reply to ``msg`` (its size header first) and have it judged against the model's
        ``want`` (header and payload)."""
        head = tconn.read(REPLY_HEADER_SIZE)
        if head.timed_out:
            self._fail("hang", f"no reply {head.waited(self.host.timeout)}", msg)
        if len(head.data) < REPLY_HEADER_SIZE:
            self._closed_unexpectedly(msg, "replies")
            return  # dead before this example: nothing more to judge
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
            return
        verdict = self.shadow.judge(msg, body.data) if self.shadow is not None else None
        if verdict is not None:  # one of the shadow-memory oracle's reads: judged over the bytes the shadow knows
            if verdict.message:
                self._fail("corruption", verdict.message, verdict.write, symptom=verdict.symptom)
            return
        wrong = self.judge.payload(msg, want_body, body.data, computed=self.computed)
        if wrong is not None:
            self._fail(wrong.kind, wrong.message, msg, symptom=wrong.symptom)

    def _check_sanitizer(self, msg: FuzzMessage | None, *, settle: bool = False) -> None:
        """An instrumented target that printed a sanitizer report it survived (UBSan recovers) broke a rule no
        reply shows: a finding of its own. A fatal report (ASan) is read with the death instead. The report may
        be read a message late (the server's output is read by another thread): shrinking moves the blame to the
        last message that still produces it."""
        target = self.host.target
        if not settle and target.sanitizer_count <= self._sanitizer_mark:
            return  # the common case costs one comparison per message
        reports = [r for r in target.sanitizer_reports(self._sanitizer_mark) if not r.fatal]
        self._sanitizer_mark = target.sanitizer_count
        if reports:
            first = reports[0]
            more = f" (and {len(reports) - 1} more report(s))" if len(reports) > 1 else ""
            self._fail("undefined-behaviour", f"the target reported {first.headline()}{more}", msg,
                       symptom=first.symptom, sanitizer=first.to_dict())

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
        if self.host.alive():
            self._fail("wrong-reply", message + " (the server itself still answers new connections)", msg)
        self._fail("hang", message, msg)

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

    def record_sent(self, msg: FuzzMessage, wire: bytes) -> None:
        """Count and record a message a strategy sent to the target alone (the model never sees it)."""
        self._writes.append((True, wire))
        self._sent.append(msg)
        self.messages += 1
        self.last = msg
        self.host.count_message(msg)

    def leave_early(self, ref: ConnRef, msg: FuzzMessage) -> None:
        """Send ``msg`` and close the connection at once, reading nothing: the server must outlive a client that
        leaves before its reply (upstream 6/7 die of SIGPIPE writing it).  The model's reply is recorded as what
        the server writes into the closed socket: a reproducer puts it after the client's FIN."""
        if self.inert:
            return
        self.prepare(ref)
        model, tconn = self.models[ref], self.tconn
        assert tconn is not None
        mbytes, _ = msg.encode(self.protocol)
        tbytes, _ = msg.encode(self.protocol, self._relocate)
        tconn.leave(tbytes)
        out = model.exchange(mbytes, end=True)
        self._writes.append((True, mbytes))
        if out.reply:
            self._writes.append((False, out.reply))
        self._sent.append(msg)
        self.messages += 1
        self.last = msg
        self.host.count_message(msg)
        self.current, self.tconn = None, None
        model.close()
        if not self.host.alive():
            self._fail("crash", f"the target died after a client closed before reading the reply of {msg.name}",
                       msg)

    def _end_target(self) -> None:
        if self.tconn is not None:
            self.tconn.close()

    def dead_before_this_example(self) -> None:
        """The target was dead before this example sent anything of its own: what killed it came earlier (a heap an
        earlier example corrupted, freed when a later connection ends) and no program of this example reproduces
        it. Not a finding: counted, the target brought back for the next example, this one sends nothing more."""
        self._end_target()
        self.host.dead_before_example()
        self.dead_before = True
        self.judge.untracked = True  # steps send nothing more

    def _closed_unexpectedly(self, msg: FuzzMessage, model_did: str) -> None:
        self._end_target()
        if msg.command is Command.HELLO and self.messages <= 1 and not self.host.alive():
            self.dead_before_this_example()
            return
        if not self.host.alive():
            if self._opening is not None and self._opening is not msg:
                # A dying process may still accept a connection: the death belongs to what came before.
                self._fail("crash", f"the target died after {self._opening.describe()} (it no longer accepts "
                           "connections)", self._opening)
            self._fail("crash", f"the target died on {msg.describe()} (it no longer accepts connections)", msg)
        self._fail("wrong-reply", f"the target closed the connection where the reference {model_did}", msg)

    def _fail(self, kind: str, message: str, msg: FuzzMessage | None, symptom: str = "",
              sanitizer: dict | None = None) -> None:
        if kind == "hang" and self.host.target.process_exited():
            kind = "crash"
            message += " (the target process then exited)"
        finding = FuzzFinding(kind, message, command=msg.name if msg else "", broken=msg.broken if msg else None)
        finding.symptom = symptom
        finding.sanitizer = sanitizer
        self.finding = finding
        if kind in ("crash", "hang"):
            finding.death = self.host.target.death_info()
            self.host.mark_dead()
        self.host.found(self, finding)
        raise finding


__all__ = ["HELLO", "SLOW_CLOSE", "Example"]
