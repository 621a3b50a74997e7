"""Both directions of one proxied connection, framed message by message as the bytes stream through.

The framing is the codec's streaming mode (:mod:`ggml_rpc.spec.framing`): only the small fixed parts of messages
(request headers, tensors, reply fields) are collected; bulk data (SET_TENSOR data, GET_TENSOR replies) is counted,
never buffered, except the data of a SET_TENSOR carrying a cache_flag, which the cache-flag rule must hash, and the
first bytes of a SET_TENSOR's data, which tell one version's framing from another's.  Violations of the rules of
:mod:`.lint` are reported as they are found.  :class:`~.proxy.Proxy` feeds it each chunk before forwarding the chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ggml_rpc.spec import (
    Command,
    Protocol,
    ProtocolError,
    Request,
    SizeMismatch,
    SpecViolation,
    UnexpectedReply,
    check_request,
    fnv1a64,
    protocol_from_hello,
    tensor_nbytes,
)
from ggml_rpc.spec.framing import Bulk, End, Head, ReplyFramer, RequestFramer
from ggml_rpc.spec.versions import PROTOCOLS

from .lint import CacheFlagTracker, Violation, other_framing, shifted_framing, shifted_framing_message

#: Largest non-bulk payload (GRAPH_COMPUTE) the checker collects; beyond it the message is passed on unchecked.
MAX_CHECKED_PAYLOAD = 256 << 20
_LONGEST_HEADER = max(p.commands[Command.SET_TENSOR].request.header_size for p in PROTOCOLS)
_NO_LIMIT = 1 << 64  # the checker refuses nothing by size: it only collects fixed parts (bounded above)


class StreamChecker:
    """Both directions of one proxied connection, framed message by message."""

    def __init__(self, connection: int, report: Callable[[Violation], None]) -> None:
        self.connection = connection
        self.report = report
        self.protocol: Protocol | None = None
        self.tracker: CacheFlagTracker | None = None
        self.lock = threading.Lock()
        self.requests = 0
        self.replies = 0
        self._last_command: str | None = None  # the latest request's command: an unexpected reply answers it
        self.broken = {True: False, False: False}  # a direction that lost its framing is no longer decoded
        self._rq = RequestFramer(None, max_payload=_NO_LIMIT, max_fixed=MAX_CHECKED_PAYLOAD)
        self._rp = ReplyFramer(None, max_payload=_NO_LIMIT)
        self._rq_fields: dict[str, Any] | None = None  # None: the current request is not checked further
        self._rq_prefix = bytearray()  # a SET_TENSOR's header and first data bytes (other versions' framing)
        self._rq_flagged: bytearray | None = None  # data of a SET_TENSOR whose hash the cache-flag rule needs

    def bulk_ahead(self, from_client: bool) -> int:
        """Bytes coming next in this direction that the checker only counts (bulk data it need not see)."""
        with self.lock:
            if self.broken[from_client]:
                return 0
            if from_client:
                if self._rq_flagged is not None or self._wants_prefix():
                    return 0
                return self._rq.bulk_ahead()
            return self._rp.bulk_ahead()

    def skip(self, from_client: bool, n: int) -> None:
        """``n`` bulk bytes (at most :meth:`bulk_ahead`) passed without being looked at."""
        with self.lock:
            framer = self._rq if from_client else self._rp
            framer.skip(n)
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

    def _violation(self, rule: str, index: int | None, from_client: bool, command: str | None, msg: str) -> None:
        self.report(Violation(rule, self.connection, index, "client->server" if from_client else "server->client",
                              command, msg))

    def _drain(self, from_client: bool) -> None:
        """Every event the queued bytes complete (the framer keeps no view of a chunk after this)."""
        framer = self._rq if from_client else self._rp
        on_event = self._request_event if from_client else self._reply_event
        while not self.broken[from_client]:
            try:
                ev = framer.next_event()
            except ProtocolError as exc:
                self._lost(from_client, exc)
                return
            if ev is None:
                return
            on_event(ev)

    def _lost(self, from_client: bool, exc: ProtocolError) -> None:
        self.broken[from_client] = True
        if from_client:
            index = self.requests
            self.requests += 1
            self._violation("DECODE", index, True, exc.command, str(exc))
        elif isinstance(exc, UnexpectedReply):
            self._violation("NO-REPLY", self.requests - 1, False, self._last_command,
                            "a reply while no request awaits one")
        elif isinstance(exc, SizeMismatch):
            req = self._rp.next_request
            self._violation("REPLY-SIZE", req.index if req is not None else None, False, exc.command, str(exc))
        else:
            self._violation("DECODE", self.replies, False, exc.command, str(exc))

    # ---- requests ----------------------------------------------------------------------------------------------

    def _wants_prefix(self) -> bool:
        head = self._rq.current
        return head is not None and head.command is Command.SET_TENSOR and self._rq_fields is not None and len(
            self._rq_prefix) < min(_LONGEST_HEADER, head.size)

    def _request_event(self, ev: Head | Bulk | End) -> None:
        if type(ev) is Bulk:
            if self._wants_prefix():
                self._rq_prefix += ev.data[: _LONGEST_HEADER - len(self._rq_prefix)]
            if self._rq_flagged is not None:
                self._rq_flagged += ev.data
        elif type(ev) is Head:
            self._start_request(ev)
        else:
            self._finish_request(ev.head)

    def _start_request(self, head: Head) -> None:
        self.requests += 1
        self._last_command = head.command.name
        self._rq_flagged = None
        self._rq_prefix.clear()
        try:
            fields = head.fields
        except ProtocolError as exc:
            self._rq_fields = None
            too_large = head.error is not None
            self._violation("DECODE", head.index, True, head.command.name,
                            f"a {head.size}-byte payload, too large to check" if too_large else str(exc))
            return
        self._rq_fields = fields
        if head.command is Command.SET_TENSOR:
            self._rq_prefix += head.fixed
        flag_field = self.protocol.cache_rule.flag_field if self.protocol else None
        if head.command is Command.SET_TENSOR and flag_field and (fields.get(flag_field) or (
                self.tracker is not None and self.tracker.after_miss)):
            self._rq_flagged = bytearray()  # the cache-flag rule needs this payload's hash
        self._rp.expect(head)

    def _finish_request(self, head: Head) -> None:
        fields = self._rq_fields
        self._rq_fields = None
        if fields is None:
            return
        command, index = head.command, head.index
        if command is Command.SET_TENSOR:
            found = self._check_set_tensor(fields, head.bulk, head.size)
            if found is not None:
                rule, msg = found
                self._violation(rule, index, True, command.name, msg)
                return
        else:
            try:
                check_request(Request(command, fields, None, head.size, 0, index, head.fixed))
            except SpecViolation as exc:
                self._violation("REQUEST", index, True, command.name, str(exc))
                return
        if self.tracker is not None:
            flagged = self._rq_flagged
            self._rq_flagged = None

            def digest() -> int:
                return fnv1a64(flagged) if flagged is not None else -1

            v = self.tracker.request(command, fields, index, digest)
            if v is not None:
                self.report(v)

    def _check_set_tensor(self, f: dict[str, Any], n: int, total: int) -> tuple[str, str] | None:
        """Content and framing rules of a SET_TENSOR whose data streamed through (only its size is known)."""
        try:
            nbytes = tensor_nbytes(f["tensor"])
        except (KeyError, ValueError) as exc:
            return "REQUEST", f"tensor: {exc}"
        if self.protocol is None or not n:
            return None
        head = memoryview(bytes(self._rq_prefix))  # the header and first data bytes: the rest streamed through
        if f["offset"] + n > nbytes:
            msg = f"region offset {f['offset']} + {n} bytes runs past the tensor's {nbytes} bytes"
            other = other_framing(self.protocol, head, total)
            if other is not None:
                return "FRAMING", f"{msg}; it fits the {other.label} layout"
            return "REQUEST", msg
        if f["offset"] + n == nbytes - 1:
            other = shifted_framing(self.protocol, head, total)
            if other is not None:
                return "FRAMING", shifted_framing_message(self.protocol, other)
        return None

    # ---- replies -----------------------------------------------------------------------------------------------

    def _reply_event(self, ev: Head | Bulk | End) -> None:
        if type(ev) is not End:
            return
        head = ev.head
        self.replies += 1
        if head.command is Command.GET_TENSOR:
            return
        fields = head.fields
        if head.command is Command.HELLO:
            self.protocol = protocol_from_hello(fields)
            if self.protocol is None:
                self._violation("DECODE", head.request.index, False, "HELLO", f"server announces {fields['major']}."
                                f"{fields['minor']}.{fields['patch']}: not covered by this kit")
                self.broken[True] = self.broken[False] = True
                return
            self._rq.protocol = self._rp.protocol = self.protocol
            self.tracker = CacheFlagTracker(self.protocol, self.connection)
        if self.tracker is not None:
            self.tracker.reply(head.command, fields)
