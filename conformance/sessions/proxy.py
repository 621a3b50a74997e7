"""A transparent recording proxy between a ggml RPC client and a server.

Bytes are forwarded as they arrive, in both directions, and on the way each chunk is:

* framed into messages by a streaming decoder (:mod:`.stream_checker`) that keeps only the small fixed parts of
  messages (request headers, tensors, reply fields): bulk data (SET_TENSOR data, GET_TENSOR replies) is counted and
  passed on, never buffered, except the data of a SET_TENSOR carrying a cache_flag, which the cache-flag rule must
  hash;
* written to a pcap (optional) as TCP segments of the connection the client made (on a thread of its own);
* checked (optional) against the rule table (:mod:`ggml_rpc.spec.rules`) by the same checker ``ggml-rpc lint``
  feeds from a capture, reported as they happen.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pcapwrite import PcapWriter, TcpFlow
from .stream_checker import StreamChecker, Violation

#: Bytes read from a socket at a time.
CHUNK = 1 << 20

#: Bulk runs at least this long are spliced (when no pcap needs the bytes).
SPLICE_MIN = 256 << 10
_PIPE_SIZE = 1 << 20


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


#: Buffers (of CHUNK bytes) each pump may have in flight to the pcap recorder.  Allocated only as a transfer needs
#: them: a small session uses one or two, a bulk transfer on a disk slower than loopback lets forwarding run up to
#: this far ahead of the pcap instead of waiting for every write (the file writes then overlap the transfer).
POOL = 64


@dataclass
class ProxyStats:
    connections: int = 0
    requests: int = 0
    replies: int = 0
    bytes_c2s: int = 0
    bytes_s2c: int = 0
    violations: list[Violation] = field(default_factory=list)


Address = tuple[str, int]


def _listener(listen: Address) -> socket.socket:
    family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(listen)
        sock.listen(16)
    except OSError:
        sock.close()
        raise
    return sock


class Proxy:
    """Listens on ``listen``, connects each client to ``upstream``, forwards, records and checks.

    A fleet (a model split over several servers) is fronted by one proxy: ``upstream`` and ``listen`` are then
    lists, one listening address per server, and every connection of every server goes into one recording and one
    report.
    """

    def __init__(
        self,
        upstream: Address | Sequence[Address],
        listen: Address | Sequence[Address] = ("127.0.0.1", 0),
        *,
        pcap: str | Path | None = None,
        check: bool = False,
        on_violation: Callable[[Violation], None] | None = None,
        mss: int | None = None,
    ) -> None:
        upstreams = [upstream] if isinstance(upstream[0], str) else list(upstream)  # type: ignore[list-item]
        listens = [listen] if isinstance(listen[0], str) else list(listen)  # type: ignore[list-item]
        if len(listens) == 1 and len(upstreams) > 1:
            listens = [(listens[0][0], 0)] * len(upstreams) if listens[0][1] == 0 else listens
        if len(listens) != len(upstreams):
            raise ValueError(f"{len(upstreams)} upstream(s) need as many listening addresses ({len(listens)} given)")
        #: (listening socket, upstream address) per fronted server.
        self._fronts: list[tuple[socket.socket, Address]] = []
        try:
            for at, up in zip(listens, upstreams, strict=True):
                self._fronts.append((_listener(at), up))
        except OSError:
            for sock, _ in self._fronts:
                sock.close()
            raise
        self.sock, self.upstream = self._fronts[0]
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

    @property
    def addresses(self) -> list[Address]:
        """Where each fronted server is listened for, in the order of the upstreams."""
        return [sock.getsockname()[:2] for sock, _ in self._fronts]

    def _report(self, v: Violation) -> None:
        with self._stats_lock:
            self.stats.violations.append(v)
        if self.check and self.on_violation is not None:
            self.on_violation(v)

    def serve_forever(self) -> None:
        """Accept on every listening address until :meth:`stop` (the first on this thread, others on their own)."""
        extra = [threading.Thread(target=self._accept, args=(sock, up), daemon=True, name="ggml-rpc-proxy-accept")
                 for sock, up in self._fronts[1:]]
        for t in extra:
            t.start()
        self._accept(*self._fronts[0])
        for t in extra:
            t.join(timeout=10)

    def _accept(self, sock: socket.socket, upstream: Address) -> None:
        listen = sock.getsockname()[:2]
        # Woken every 0.2 s: a signal that lands just before a blocking accept() would otherwise wait for a client.
        sock.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                client, peer = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with self._stats_lock:
                index = self.stats.connections
                self.stats.connections += 1
            t = threading.Thread(target=self._session, args=(client, peer, index, upstream, listen), daemon=True,
                                 name=f"ggml-rpc-proxy-{index}")
            t.start()
            with self._stats_lock:
                self._threads.append(t)

    def _session(self, client: socket.socket, peer: tuple, index: int, target: Address, listen: Address) -> None:
        try:
            upstream = socket.create_connection(target)
        except OSError as exc:
            print(f"ggml-rpc proxy: cannot reach upstream {target[0]}:{target[1]}: {exc}", file=sys.stderr)
            client.close()
            return
        with self._stats_lock:
            self._active.update((client, upstream))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        checker = StreamChecker(index, self._report)
        flow: TcpFlow | None = None
        if self._pcap is not None:
            with self._pcap_lock:
                kwargs = {"mss": self._mss} if self._mss else {}
                flow = self._pcap.flow(client=(peer[0], peer[1]), server=listen, **kwargs)
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
        checker.close()  # a request cut short, or one still waiting for a reply, is judged now
        with self._stats_lock:
            self._active.difference_update((client, upstream))
        for s in (client, upstream):
            s.close()
        if flow is not None and self._recorder is not None:
            self._recorder.submit("close", flow, time.time(), closed_first[0] if closed_first else True)
        with self._stats_lock:
            self.stats.requests += checker.requests
            self.stats.replies += checker.replies

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool, checker: StreamChecker,
              flow: TcpFlow | None, closed_first: list[bool]) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        total = 0
        pipe = _splice_pipe() if flow is None else None
        pool: queue.Queue | None = None
        allocated = 0
        if flow is not None:
            pool = queue.Queue()
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
                    try:
                        buf = pool.get_nowait()  # a buffer the recorder is done with
                    except queue.Empty:
                        if allocated < POOL:
                            allocated += 1
                            buf = bytearray(CHUNK)
                        else:
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
        for sock, _ in self._fronts:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        deadline = time.monotonic() + grace
        with self._stats_lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._stats_lock:
            active = list(self._active)
        for s in active:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=30)
        if self._recorder is not None:
            self._recorder.close()


@contextlib.contextmanager
def running_proxy(upstream: Address | Sequence[Address], *, pcap: str | Path | None = None, check: bool = False,
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
