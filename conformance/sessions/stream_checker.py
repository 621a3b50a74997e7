"""The one checker of a connection's two byte streams against the rule table (:mod:`ggml_rpc.spec.rules`).

``ggml-rpc proxy --check`` feeds it each chunk as it passes (:meth:`StreamChecker.client_bytes`,
:meth:`~StreamChecker.server_bytes`); ``ggml-rpc lint`` feeds it a captured connection's two streams
(:meth:`~StreamChecker.run`).  Same checker, same table: the same bytes give the same violations.

The framing is the codec's streaming mode (:mod:`ggml_rpc.spec.framing`): only the small fixed parts of messages
(request headers, tensors, reply fields) are collected; bulk data (SET_TENSOR data, GET_TENSOR replies) is counted,
never buffered, except the first bytes of a SET_TENSOR's data (the framing rules tell one version's layout from
another's by them) and the data the cache-flag rules must hash (:func:`~ggml_rpc.spec.rules.wants_data_hash`,
decided from the head, before the data streams past).

A request is judged once every earlier reply has arrived, so that "what was asked before" (the hash miss of the
cache-flag rules) means the same whether a client waits for each reply or not, and whatever order the two
directions' chunks are fed in; at the end of the connection (:meth:`~StreamChecker.close`) whatever is left is
judged with what is known.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ggml_rpc.spec import (
    Command,
    Direction,
    Protocol,
    ProtocolError,
    SizeMismatch,
    UnexpectedReply,
    protocol_from_hello,
)
from ggml_rpc.spec.checks import rule_error
from ggml_rpc.spec.facts import FNV_OFFSET_BASIS, fnv1a64_continue
from ggml_rpc.spec.framing import Bulk, End, Head, ReplyFramer, RequestFramer
from ggml_rpc.spec.rules import ConnState, Message, first_broken, wants_data_hash
from ggml_rpc.spec.versions import PROTOCOLS

from .truncation import CAPTURE_TRUNCATED, CaptureCut, reply_cut, request_cut

#: Largest non-bulk payload (GRAPH_COMPUTE) the checker collects; beyond it the message is passed on unchecked.
MAX_CHECKED_PAYLOAD = 256 << 20
_LONGEST_HEADER = max(p.commands[Command.SET_TENSOR].request.header_size for p in PROTOCOLS)
_NO_LIMIT = 1 << 64  # the checker refuses nothing by size: it only collects fixed parts (bounded above)


@dataclass(frozen=True)
class Violation:
    """One broken rule of the table, located in the connection."""

    rule: str
    connection: int
    #: Index of the request concerned (replies are located by their request's index), None when unknown.
    index: int | None
    direction: Direction
    command: str | None
    message: str

    def line(self) -> str:
        at = f"message {self.index}" if self.index is not None else "message ?"
        cmd = f" {self.command}" if self.command else ""
        return f"connection {self.connection} {at}{cmd} ({self.direction}) [{self.rule}]: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Buffer = bytes | bytearray | memoryview


def _chunks(data: Buffer | Iterable[Buffer]) -> Iterator[Buffer]:
    return iter((data,)) if isinstance(data, bytes | bytearray | memoryview) else iter(data)


class StreamChecker:
    """Both directions of one connection, framed message by message and judged by the rule table."""

    def __init__(self, connection: int, report: Callable[[Violation], None], *, protocol: Protocol | None = None,
                 expect_hello: bool = True) -> None:
        self.connection = connection
        self.report = report
        self.state = ConnState(protocol)
        self._forced = protocol is not None  # --proto: the HELLO reply does not change the version
        self.lock = threading.Lock()
        self.requests = 0
        self.replies = 0
        self.broken = {True: False, False: False}  # a direction that lost its framing is no longer decoded
        #: (request index, port) of every COMM_INIT of rank 0: where an 8.0.0 servers' link will connect.
        self.comm_inits: list[tuple[int, int]] = []
        self._rq = RequestFramer(protocol, max_payload=_NO_LIMIT, max_fixed=MAX_CHECKED_PAYLOAD,
                                 expect_hello=expect_hello)
        self._rp = ReplyFramer(protocol, max_payload=_NO_LIMIT)
        self._fields: dict[str, Any] | None = None  # the current request's fields; None: not judged
        self._prefix = bytearray()  # a SET_TENSOR's header and first data bytes
        #: running FNV-1a of the data the cache-flag rules need hashed (None: not hashed), never the data itself: a
        #: SET_TENSOR after a hash miss may be gigabytes
        self._hashed: int | None = None
        self._previous: Command | None = None  # the command framed before the current request
        self._pending: deque[Message] = deque()  # complete requests waiting for earlier replies
        self._awaiting: deque[int] = deque()  # requests whose reply has not come, in order
        self._silent: tuple[int, str] | None = None  # the latest request without a reply
        self._answered = -1  # index of the latest request whose reply came
        self._closed = False

    # ---- feeding -----------------------------------------------------------------------------------------------

    def bulk_ahead(self, from_client: bool) -> int:
        """Bytes coming next in this direction that the checker only counts (bulk data it need not see)."""
        with self.lock:
            if self.broken[from_client]:
                return 0
            if from_client:
                if self._hashed is not None or self._wants_prefix():
                    return 0
                return self._rq.bulk_ahead()
            return self._rp.bulk_ahead()

    def skip(self, from_client: bool, n: int) -> None:
        """``n`` bulk bytes (at most :meth:`bulk_ahead`) passed without being looked at."""
        with self.lock:
            (self._rq if from_client else self._rp).skip(n)
            self._drain(from_client)

    def client_bytes(self, chunk: memoryview) -> None:
        with self.lock:
            if not self.broken[True]:
                self._rq.receive_data(chunk)
                self._drain(True)

    def server_bytes(self, chunk: memoryview) -> None:
        with self.lock:
            if not self.broken[False]:
                self._rp.receive_data(chunk)
                self._drain(False)

    def run(self, c2s: Buffer | Iterable[Buffer], s2c: Buffer | Iterable[Buffer], *, client_cut: int | None = None,
            server_cut: int | None = None) -> None:
        """A whole captured connection: requests in order, each reply read as soon as it is due (as the proxy
        sees them), then :meth:`close`.  Each direction is the bytes or an iterable of chunks (a capture's streams
        read a window at a time): chunks are fed only as the judging needs them, so memory stays bounded.
        ``client_cut``/``server_cut``: that direction's length, when the capture stopped before it ended."""
        feeds = {True: _chunks(c2s), False: _chunks(s2c)}
        with self.lock:
            while True:
                while True:
                    if self._reply_due():
                        if self._step(False):
                            continue
                        # A due reply comes before the next request is judged (the HELLO reply names the version
                        # every later request is read in): feed the server's side first, while it has bytes.
                        chunk = next(feeds[False], None)
                        if chunk is not None:
                            self._rp.receive_data(chunk)
                            continue
                    if not (self._step(True) or self._step(False)):
                        break
                # Nothing more from what was fed: feed the client's side, then the server's.
                for from_client in (True, False):
                    chunk = next(feeds[from_client], None)
                    if chunk is not None:
                        (self._rq if from_client else self._rp).receive_data(chunk)
                        break
                else:
                    break
        self.close(client_cut=client_cut, server_cut=server_cut)

    def close(self, *, client_cut: int | None = None, server_cut: int | None = None) -> None:
        """The connection ended: judge a request cut short by what arrived of it, and whatever still waits.

        A direction the capture stopped before it ended (its length given as ``client_cut``/``server_cut``) is
        different: a message cut there is reported as ``CAPTURE-TRUNCATED``, not judged (its peer did not cut it
        short, the recording did)."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            head = self._rq.current
            cuts: list[CaptureCut] = []
            if client_cut is not None and not self.broken[True] and self._rq.in_message:
                cuts.append(request_cut(self.connection, self._rq, self.requests, client_cut))
            elif head is not None and self._fields is not None:
                self._complete(head)  # the data never came: it is judged by its claimed length, unhashed
            if server_cut is not None and not self.broken[False]:
                due = reply_cut(self.connection, self._rp, server_cut)
                cuts += [due] if due is not None else []
            self._flush(everything=True)
            for cut in cuts:
                self.report(Violation(CAPTURE_TRUNCATED, self.connection, cut.index, cut.direction, cut.command,
                                      cut.detail()))

    # ---- framing -----------------------------------------------------------------------------------------------

    def _reply_due(self) -> bool:
        # A server answers a whole request: while one is still arriving, its reply is not due yet.
        return not self.broken[False] and self._rq.current is None and (
            self._rp.awaiting > 0 or self._rp.current is not None)

    def _step(self, from_client: bool) -> bool:
        """One event of one direction; False when that direction has nothing more to give."""
        if self.broken[from_client]:
            return False
        framer = self._rq if from_client else self._rp
        try:
            ev = framer.next_event()
        except ProtocolError as exc:
            self._lost(from_client, exc)
            return True
        if ev is None:
            return False
        (self._request_event if from_client else self._reply_event)(ev)
        return True

    def _drain(self, from_client: bool) -> None:
        while self._step(from_client):
            pass

    def _violation(self, rule: str, index: int | None, from_client: bool, command: str | None, msg: str) -> None:
        self.report(Violation(rule, self.connection, index, Direction.of(from_client), command, msg))

    def _lost(self, from_client: bool, exc: ProtocolError) -> None:
        self.broken[from_client] = True
        if from_client:
            self.requests += 1
            self._violation("DECODE", self.requests - 1, True, exc.command, str(exc))
            return
        self._flush(everything=True)  # no reply comes any more: nothing waits for one
        nxt = self._rp.next_request
        silent = self._silent if self._silent is not None and self._silent[0] > self._answered else None
        if isinstance(exc, SizeMismatch) and nxt is not None and not (
                silent is not None and silent[0] < nxt.index and "reply size 0," in exc.message):
            self._violation("REPLY-SIZE", nxt.index, False, exc.command, str(exc))
        elif isinstance(exc, UnexpectedReply | SizeMismatch) and silent is not None:
            # An empty reply to a command that has none, read before or after a later request was sent.
            self._violation("NO-REPLY", silent[0], False, silent[1], f"reply bytes where none is due: {silent[1]} "
                            f"has no reply in {self.state.protocol.label if self.state.protocol else '?'} ({exc})")
        else:
            self._violation("REPLY-DECODE", nxt.index if nxt is not None else self.replies, False, exc.command,
                            str(exc))

    # ---- requests ----------------------------------------------------------------------------------------------

    def _wants_prefix(self) -> bool:
        head = self._rq.current
        return head is not None and head.command is Command.SET_TENSOR and self._fields is not None and len(
            self._prefix) < min(_LONGEST_HEADER, head.size)

    def _request_event(self, ev: Head | Bulk | End) -> None:
        if type(ev) is Bulk:
            if self._wants_prefix():
                self._prefix += ev.data[: _LONGEST_HEADER - len(self._prefix)]
            if self._hashed is not None:
                self._hashed = fnv1a64_continue(self._hashed, ev.data)
        elif type(ev) is Head:
            self._start(ev)
        elif self._fields is not None:
            self._complete(ev.head)

    def _start(self, head: Head) -> None:
        self.requests += 1
        previous, self._previous = self._previous, head.command
        self._hashed = None
        self._prefix.clear()
        try:
            fields = head.fields
        except ProtocolError as exc:
            self._fields = None
            too_large = head.error is not None
            self._violation("DECODE", head.index, True, head.command.name,
                            f"a {head.size}-byte payload, too large to check" if too_large else str(exc))
            return
        self._fields = fields
        self._prefix += head.fixed
        if wants_data_hash(self.state.protocol, head.command, fields, previous):
            self._hashed = FNV_OFFSET_BASIS
        if head.command is Command.COMM_INIT and fields.get("rank") == 0:
            self.comm_inits.append((head.index, fields["port"]))
        if self._rp.expect(head):
            self._awaiting.append(head.index)
        else:
            self._silent = (head.index, head.command.name)

    def _complete(self, head: Head) -> None:
        fields, self._fields = self._fields, None
        assert fields is not None
        hashed, self._hashed = self._hashed, None
        digest = hashed if hashed is not None and head is not self._rq.current else None
        self._pending.append(Message(head.command, fields, head.index, head.offset, head.size, head.bulk,
                                     memoryview(bytes(self._prefix)), digest))
        self._flush()

    def _flush(self, *, up_to: int | None = None, everything: bool = False) -> None:
        """Judge the complete requests no earlier reply is missing for (all of them with ``everything``)."""
        while self._pending:
            msg = self._pending[0]
            if up_to is not None:
                ready = msg.index <= up_to  # the requests a reply answers or follows, and no later one
            else:
                ready = everything or not self._awaiting or self._awaiting[0] >= msg.index
            if not ready:
                return
            self._pending.popleft()
            broken = first_broken(msg, self.state)
            if broken is not None:
                err = rule_error(*broken, msg.command, dict(msg.fields), msg.offset, tag=False)
                self._violation(broken[0].id, msg.index, True, msg.command.name, str(err))
            self.state.requested(msg)

    # ---- replies -----------------------------------------------------------------------------------------------

    def _reply_event(self, ev: Head | Bulk | End) -> None:
        if type(ev) is not End:
            return
        head = ev.head
        index = head.request.index
        self.replies += 1
        self._answered = index
        if self._awaiting and self._awaiting[0] == index:
            self._awaiting.popleft()
        self._flush(up_to=index)  # the request this reply answers is judged before the reply changes the state
        if head.command in (Command.GET_TENSOR, Command.GET_TENSOR_2D):
            self._flush()
            return
        fields = head.fields
        if head.command is Command.HELLO and not self._forced:
            protocol = protocol_from_hello(fields)
            if protocol is None:
                self._violation("REPLY-DECODE", index, False, "HELLO", f"server announces {fields['major']}."
                                f"{fields['minor']}.{fields['patch']}: not covered by this kit")
                self.broken[True] = self.broken[False] = True
                return
            self.state.protocol = self._rq.protocol = self._rp.protocol = protocol
        self.state.replied(head.command, fields)
        self._flush()


__all__ = ["MAX_CHECKED_PAYLOAD", "StreamChecker", "Violation"]
