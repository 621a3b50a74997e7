"""A transparent recording proxy between a ggml RPC client and a server.

Bytes are forwarded as they arrive, in both directions, and on the way each chunk is:

* framed into messages by a streaming decoder that keeps only the small fixed parts of messages (request headers,
  tensors, reply fields): bulk data (SET_TENSOR data, GET_TENSOR replies) is counted and passed on, never buffered,
  except the data of a SET_TENSOR carrying a cache_flag, which the cache-flag rule must hash;
* written to a pcap (optional) as TCP segments of the connection the client made;
* checked (optional) against the rules of :mod:`ggml_rpc.conformance.sessions.lint`, reported as they happen.

Each chunk is decoded before it is forwarded, so the reply decoder always knows the request a reply answers and the
request decoder knows the version from the HELLO reply before the client can send anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
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
from .pcapwrite import PcapWriter, TcpFlow

#: Bytes read from a socket at a time.
CHUNK = 1 << 20
#: Largest non-bulk payload (GRAPH_COMPUTE) the checker collects; beyond it the message is passed on unchecked.
MAX_CHECKED_PAYLOAD = 256 << 20


#: Bulk runs at least this long are spliced (when no pcap needs the bytes).
SPLICE_MIN = 256 << 10
_PIPE_SIZE = 1 << 20
_LONGEST_HEADER = max(p.commands[Command.SET_TENSOR].request.header_size for p in PROTOCOLS)


def _splice_pipe() -> tuple[int, int] | None:
    """A pipe for :func:`os.splice` (Linux), as large as allowed; None where splicing is not available."""
    if not hasattr(os, "splice"):
        return None
    r, w = os.pipe()
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    return r, w


def _splice(src: socket.socket, dst: socket.socket, count: int, pipe: tuple[int, int]) -> int:
    """Move ``count`` bytes from ``src`` to ``dst`` without copying them to user space; returns bytes moved
    (fewer only if ``src`` reached end of stream)."""
    r, w = pipe
    left = count
    while left:
        n = os.splice(src.fileno(), w, min(left, _PIPE_SIZE))
        if n == 0:
            break
        out = 0
        while out < n:
            out += os.splice(r, dst.fileno(), n - out)
        left -= n
    return count - left


class _Checker:
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


class _Recorder:
    """Writes the pcap on its own thread, so that segmenting, checksumming and disk writes overlap forwarding.

    Pumps hand over filled buffers from a small per-pump pool (the pool bounds the memory in flight and makes a
    pump wait when the disk falls behind); the recorder returns each buffer once its bytes are written.
    """

    def __init__(self, writer: PcapWriter) -> None:
        self.writer = writer
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="ggml-rpc-proxy-pcap")
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            op, flow, args = item
            if op == "open":
                flow.open(*args)
            elif op == "close":
                ts, client_first = args
                flow.close(ts, client_first=client_first)
            else:
                from_client, buf, n, ts, pool = args
                flow.write(from_client, memoryview(buf)[:n], ts)
                pool.put(buf)

    def submit(self, op: str, flow: TcpFlow, *args: Any) -> None:
        self.queue.put((op, flow, args))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.writer.close()


#: Buffers each pump may have in flight to the pcap recorder.
POOL = 8


@dataclass
class ProxyStats:
    connections: int = 0
    requests: int = 0
    replies: int = 0
    bytes_c2s: int = 0
    bytes_s2c: int = 0
    violations: list[Violation] = field(default_factory=list)


class Proxy:
    """Listens on ``listen``, connects each client to ``upstream``, forwards, records and checks."""

    def __init__(
        self,
        upstream: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        pcap: str | Path | None = None,
        check: bool = False,
        on_violation: Callable[[Violation], None] | None = None,
        mss: int | None = None,
    ) -> None:
        self.upstream = upstream
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.host, self.port = self.sock.getsockname()[:2]
        self.check = check
        self.on_violation = on_violation
        self.stats = ProxyStats()
        self._pcap = PcapWriter(pcap) if pcap is not None else None
        self._recorder = _Recorder(self._pcap) if self._pcap is not None else None
        self._mss = mss
        self._pcap_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._active: set[socket.socket] = set()  # sockets of open sessions (cut by stop() after the grace time)
        self._stopping = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def _report(self, v: Violation) -> None:
        with self._stats_lock:
            self.stats.violations.append(v)
        if self.check and self.on_violation is not None:
            self.on_violation(v)

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                client, peer = self.sock.accept()
            except OSError:
                break
            with self._stats_lock:
                index = self.stats.connections
                self.stats.connections += 1
            t = threading.Thread(target=self._session, args=(client, peer, index), daemon=True,
                                 name=f"ggml-rpc-proxy-{index}")
            t.start()
            self._threads.append(t)

    def _session(self, client: socket.socket, peer: tuple, index: int) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError as exc:
            print(f"ggml-rpc proxy: cannot reach upstream {self.upstream[0]}:{self.upstream[1]}: {exc}",
                  file=sys.stderr)
            client.close()
            return
        with self._stats_lock:
            self._active.update((client, upstream))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        checker = _Checker(index, self._report)
        flow: TcpFlow | None = None
        if self._pcap is not None:
            with self._pcap_lock:
                kwargs = {"mss": self._mss} if self._mss else {}
                flow = self._pcap.flow(client=(peer[0], peer[1]), server=(self.host, self.port), **kwargs)
            assert self._recorder is not None
            self._recorder.submit("open", flow, time.time())
        closed_first: list[bool] = []
        pumps = [threading.Thread(target=self._pump, args=(client, upstream, True, checker, flow, closed_first),
                                  daemon=True),
                 threading.Thread(target=self._pump, args=(upstream, client, False, checker, flow, closed_first),
                                  daemon=True)]
        for p in pumps:
            p.start()
        for p in pumps:
            p.join()
        with self._stats_lock:
            self._active.difference_update((client, upstream))
        for s in (client, upstream):
            s.close()
        if flow is not None and self._recorder is not None:
            self._recorder.submit("close", flow, time.time(), closed_first[0] if closed_first else True)
        with self._stats_lock:
            self.stats.requests += checker.requests
            self.stats.replies += checker.replies

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool, checker: _Checker,
              flow: TcpFlow | None, closed_first: list[bool]) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        total = 0
        pipe = _splice_pipe() if flow is None else None
        pool: queue.Queue | None = None
        if flow is not None:
            pool = queue.Queue()
            for _ in range(POOL):
                pool.put(bytearray(CHUNK))
        try:
            while True:
                if pipe is not None:
                    ahead = checker.bulk_ahead(from_client)
                    if ahead >= SPLICE_MIN:
                        # Bulk data nobody needs to look at: moved socket -> pipe -> socket inside the kernel.
                        moved = _splice(src, dst, ahead, pipe)
                        checker.skip(from_client, moved)
                        total += moved
                        if moved < ahead:
                            break
                        continue
                if pool is not None:
                    buf = pool.get()  # waits while the recorder is POOL buffers behind
                    view = memoryview(buf)
                n = src.recv_into(view)
                if n == 0:
                    break
                chunk = view[:n]
                # Decode before forwarding: the peer cannot answer what it has not received yet.
                if from_client:
                    checker.client_bytes(chunk)
                else:
                    checker.server_bytes(chunk)
                if flow is not None and self._recorder is not None:
                    self._recorder.submit("write", flow, from_client, buf, n, time.time(), pool)
                dst.sendall(chunk)
                total += n
        except OSError:
            pass
        finally:
            if pipe is not None:
                for fd in pipe:
                    os.close(fd)
            closed_first.append(from_client)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with self._stats_lock:
                if from_client:
                    self.stats.bytes_c2s += total
                else:
                    self.stats.bytes_s2c += total

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, give open sessions ``grace`` seconds to end, then cut them; close the pcap."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        deadline = time.monotonic() + grace
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._stats_lock:
            active = list(self._active)
        for s in active:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=30)
        if self._recorder is not None:
            self._recorder.close()


@contextlib.contextmanager
def running_proxy(upstream: tuple[str, int], *, pcap: str | Path | None = None, check: bool = False,
                  on_violation: Callable[[Violation], None] | None = None, mss: int | None = None
                  ) -> Iterator[Proxy]:
    """A proxy on an ephemeral loopback port, serving on a thread until the block ends."""
    proxy = Proxy(upstream, pcap=pcap, check=check, on_violation=on_violation, mss=mss)
    t = threading.Thread(target=proxy.serve_forever, daemon=True, name="ggml-rpc-proxy")
    t.start()
    try:
        yield proxy
    finally:
        proxy.stop()
        t.join(timeout=10)
