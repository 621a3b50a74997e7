"""Both directions of one proxied connection, framed message by message as the bytes stream through.

The checker keeps only the small fixed parts of messages (request headers, tensors, reply fields): bulk data
(SET_TENSOR data, GET_TENSOR replies) is counted, never buffered, except the data of a SET_TENSOR carrying a
cache_flag, which the cache-flag rule must hash.  Violations of the rules of :mod:`.lint` are reported as they are
found.  :class:`~.proxy.Proxy` feeds it each chunk before forwarding the chunk.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ggml_rpc.spec import (
    REPLY_HEADER_SIZE,
    REQUEST_HEADER_SIZE,
    V6,
    Command,
    Protocol,
    ProtocolError,
    Request,
    SpecViolation,
    check_request,
    command_name,
    decode_payload,
    fnv1a64,
    protocol_from_hello,
    tensor_nbytes,
)
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER
from ggml_rpc.spec.messages import Shape
from ggml_rpc.spec.versions import PROTOCOLS

from .lint import CacheFlagTracker, Violation, other_framing, shifted_framing, shifted_framing_message

#: Largest non-bulk payload (GRAPH_COMPUTE) the checker collects; beyond it the message is passed on unchecked.
MAX_CHECKED_PAYLOAD = 256 << 20
_LONGEST_HEADER = max(p.commands[Command.SET_TENSOR].request.header_size for p in PROTOCOLS)


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
        # request side
        self._rq_head = bytearray()
        self._rq: tuple[int, int, int] | None = None  # (cmd, size, index) of the request being read
        self._rq_body = bytearray()
        self._rq_fixed = 0  # bytes of the body to collect (the rest streams through)
        self._rq_left = 0
        self._rq_fields: dict[str, Any] | None = None
        self._rq_flagged: bytearray | None = None  # data of a SET_TENSOR whose hash the cache-flag rule needs
        # reply side
        self._pending: deque[tuple[Request, int]] = deque()  # (request, expected reply size)
        self._rp_head = bytearray()
        self._rp: tuple[Request, int] | None = None
        self._rp_body = bytearray()
        self._rp_left = 0

    def bulk_ahead(self, from_client: bool) -> int:
        """Bytes coming next in this direction that the checker only counts (bulk data it need not see)."""
        with self.lock:
            if self.broken[from_client]:
                return 0
            if from_client:
                if self._rq is not None and not self._rq_fixed and self._rq_flagged is None:
                    return self._rq_left
            elif self._rp is not None and self._rp[0].command is Command.GET_TENSOR:
                return self._rp_left
            return 0

    def skip(self, from_client: bool, n: int) -> None:
        """``n`` bulk bytes (at most :meth:`bulk_ahead`) passed without being looked at."""
        with self.lock:
            if from_client:
                self._rq_left -= n
                if self._rq is not None and not self._rq_left:
                    self._finish_request()
            else:
                self._rp_left -= n
                if self._rp is not None and not self._rp_left:
                    self._finish_reply()

    def _violation(self, rule: str, index: int | None, from_client: bool, command: str | None, msg: str) -> None:
        self.report(Violation(rule, self.connection, index, "client->server" if from_client else "server->client",
                              command, msg))

    # ---- requests ----------------------------------------------------------------------------------------------

    def client_bytes(self, chunk: memoryview) -> None:
        with self.lock:
            pos, n = 0, chunk.nbytes
            while pos < n and not self.broken[True]:
                pos = self._request_step(chunk, pos)

    def _request_step(self, chunk: memoryview, pos: int) -> int:
        if self._rq is None:
            take = min(REQUEST_HEADER_SIZE - len(self._rq_head), chunk.nbytes - pos)
            self._rq_head += chunk[pos : pos + take]
            pos += take
            if len(self._rq_head) == REQUEST_HEADER_SIZE:
                cmd, size = REQUEST_HEADER.unpack(self._rq_head)
                self._rq_head.clear()
                self._start_request(cmd, size)
            return pos
        if self._rq_fixed:
            take = min(self._rq_fixed, chunk.nbytes - pos)
            self._rq_body += chunk[pos : pos + take]
            self._rq_fixed -= take
            self._rq_left -= take
            pos += take
            if not self._rq_fixed:
                self._head_complete()
        else:
            take = min(self._rq_left, chunk.nbytes - pos)
            if self._rq_flagged is not None:
                self._rq_flagged += chunk[pos : pos + take]
            self._rq_left -= take
            pos += take
        if self._rq is not None and not self._rq_left and not self._rq_fixed:
            self._finish_request()
        return pos

    def _start_request(self, cmd: int, size: int) -> None:
        index = self.requests
        self.requests += 1
        self._last_command = command_name(cmd)
        table = self.protocol or V6
        spec = table.spec(cmd)
        if spec is None or (self.protocol is None and cmd != Command.HELLO):
            self._violation("DECODE", index, True, command_name(cmd), f"command {cmd} is not a command of "
                            f"{table.label}" if spec is None else "a request before the HELLO reply")
            self.broken[True] = True
            return
        req = spec.request
        if req.shape is Shape.FIXED and size != req.header_size:
            self._violation("DECODE", index, True, command_name(cmd), f"size {size}, the layout needs "
                            f"{req.header_size}")
            self.broken[True] = True
            return
        self._rq = (cmd, size, index)
        self._rq_body.clear()
        self._rq_fields = None
        self._rq_flagged = None
        self._rq_left = size
        if req.shape is Shape.HEADER_DATA:
            # The longest SET_TENSOR header of any version: enough to tell one version's framing from another's.
            self._rq_fixed = min(_LONGEST_HEADER, size)
        elif size <= MAX_CHECKED_PAYLOAD:
            self._rq_fixed = size
        else:
            self._rq_fixed = 0
            self._violation("DECODE", index, True, command_name(cmd), f"a {size}-byte payload, too large to check")
        if size == 0:
            self._head_complete()
            self._finish_request()

    def _head_complete(self) -> None:
        assert self._rq is not None
        cmd, size, index = self._rq
        spec = (self.protocol or V6).spec(cmd)
        assert spec is not None
        body = memoryview(bytes(self._rq_body))
        if spec.request.shape is Shape.HEADER_DATA and len(body) < spec.request.header_size:
            self._violation("DECODE", index, True, command_name(cmd), f"size {size} is below the header's "
                            f"{spec.request.header_size} bytes")
            return
        try:
            fields, _ = decode_payload(spec.request, body, command=command_name(cmd))
        except ProtocolError as exc:
            self._violation("DECODE", index, True, command_name(cmd), str(exc))
            return
        self._rq_fields = fields
        flag_field = self.protocol.cache_rule.flag_field if self.protocol else None
        if cmd == Command.SET_TENSOR and flag_field and (fields.get(flag_field) or (
                self.tracker is not None and self.tracker.after_miss)):
            self._rq_flagged = bytearray()  # the cache-flag rule needs this payload's hash
        command = Command(cmd)
        if spec.has_reply:
            self._pending.append((Request(command, fields, None, size, 0, index), spec.reply_size(fields)))

    def _finish_request(self) -> None:
        assert self._rq is not None
        cmd, size, index = self._rq
        self._rq = None
        fields = self._rq_fields
        if fields is None:
            return
        command = Command(cmd)
        spec = (self.protocol or V6).spec(cmd)
        assert spec is not None
        header = spec.request.header_size if spec.request.shape is Shape.HEADER_DATA else size
        req = Request(command, fields, None, size, 0, index, memoryview(self._rq_body))
        if command is Command.SET_TENSOR:
            found = self._check_set_tensor(fields, size - header, size)
            if found is not None:
                rule, msg = found
                self._violation(rule, index, True, command.name, msg)
                return
        else:
            try:
                check_request(req)
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
        head = memoryview(bytes(self._rq_body))  # only the header: the data streamed through, its size is enough
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

    def server_bytes(self, chunk: memoryview) -> None:
        with self.lock:
            pos, n = 0, chunk.nbytes
            while pos < n and not self.broken[False]:
                pos = self._reply_step(chunk, pos)

    def _reply_step(self, chunk: memoryview, pos: int) -> int:
        if self._rp is None:
            take = min(REPLY_HEADER_SIZE - len(self._rp_head), chunk.nbytes - pos)
            self._rp_head += chunk[pos : pos + take]
            pos += take
            if len(self._rp_head) == REPLY_HEADER_SIZE:
                (size,) = REPLY_HEADER.unpack(self._rp_head)
                self._rp_head.clear()
                if not self._pending:
                    self._violation("NO-REPLY", self.requests - 1, False, self._last_command,
                                    f"a {size}-byte reply while no request awaits one")
                    self.broken[False] = True
                    return pos
                req, expected = self._pending.popleft()
                if size != expected:
                    self._violation("REPLY-SIZE", req.index, False, req.command.name,
                                    f"reply size {size}, expected {expected}")
                    self.broken[False] = True
                    return pos
                self._rp = (req, size)
                self._rp_body.clear()
                self._rp_left = size
                if size == 0:
                    self._finish_reply()
            return pos
        req, size = self._rp
        take = min(self._rp_left, chunk.nbytes - pos)
        if req.command is not Command.GET_TENSOR:
            self._rp_body += chunk[pos : pos + take]
        self._rp_left -= take
        pos += take
        if not self._rp_left:
            self._finish_reply()
        return pos

    def _finish_reply(self) -> None:
        assert self._rp is not None
        req, _size = self._rp
        self._rp = None
        self.replies += 1
        if req.command is Command.GET_TENSOR:
            return
        spec = (self.protocol or V6).spec(req.command)
        assert spec is not None and spec.reply
        fields, _ = decode_payload(spec.reply, memoryview(self._rp_body), command=req.command.name)  # type: ignore[arg-type]
        if req.command is Command.HELLO:
            self.protocol = protocol_from_hello(fields)
            if self.protocol is None:
                self._violation("DECODE", req.index, False, "HELLO", f"server announces {fields['major']}."
                                f"{fields['minor']}.{fields['patch']}: not covered by this kit")
                self.broken[True] = self.broken[False] = True
                return
            self.tracker = CacheFlagTracker(self.protocol, self.connection)
        if self.tracker is not None:
            self.tracker.reply(req.command, fields)
