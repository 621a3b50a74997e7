"""The reference server's network I/O, all of it: the accept loop, the loop that feeds each connection's sans-IO
core (:mod:`.core`) from its socket, the servers' link of the 8.0.0 communicator, and an in-process server for
tests, the harness and benchmarks.  No other module of ``reference/`` opens, reads or writes a socket.

Like upstream, one connection is served at a time: the accept loop runs the connection itself, so a second client
waits in the listen backlog until the first leaves.  ``concurrent`` serves each connection on its own thread
(for test farms); connections then share nothing but the hash cache.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from ggml_rpc.spec import DEFAULT_HOST, Protocol
from ggml_rpc.spec.facts import CONN_CAPS_SIZE

from .cache import HashCache
from .closing import Close, PeerGone
from .config import ServerConfig, make_config
from .core import ServerCore
from .graph_commands import builtin_executor

log = logging.getLogger("ggml_rpc.reference")


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    try:
        return all(ipaddress.ip_address(info[4][0].split("%", 1)[0]).is_loopback for info in infos)
    except ValueError:
        return False


def limit_blas_threads(threads: int) -> None:
    """Cap the threads of every BLAS/OpenMP pool loaded in this process (process-wide, as BLAS pools are)."""
    from threadpoolctl import threadpool_limits

    if threads < 1:
        raise ValueError("threads must be at least 1")
    threadpool_limits(limits=threads)


#: Bytes taken from the socket at a time outside bulk data (a request header and its fixed fields, many pipelined).
#: Payload bytes that come in the same read are copied from here into tensor memory: a chunk of 64 KiB copied that
#: much of every large SET_TENSOR twice (SET_TENSOR 1 MiB against upstream 7.0.0, 100 paired samples: 0.96-0.98x
#: with 64 KiB, 0.99-1.04x with 4 or 8 KiB).  8 KiB still takes a 4 KiB SET_TENSOR, or a few small requests, at once.
_RECV_CHUNK = 1 << 13
#: One non-blocking read without switching the socket's mode (two system calls fewer per poll).
_DONTWAIT = socket.MSG_DONTWAIT
#: Seconds a bulk read retries an empty socket before it sleeps, when the connection polls (ServerConfig.poll_us):
#: mid-message the client's next bytes come within microseconds, and waking a sleeping reader costs an
#: inter-processor interrupt (about five per megabyte).  SET_TENSOR 1 MiB vs upstream 7.0.0 on two CPUs: 0.82-0.95x
#: sleeping, 1.14-1.17x retrying; 1.06x either way on one CPU.  No yield: one here often looked like sharing.
_BULK_SPIN = 30e-6
#: A yield of the CPU that took longer than this (seconds) let another task run there: an idle CPU gives it back in
#: well under 2 microseconds (99.9th percentile 1.3 us measured here).  Polling then competes with that task, which
#: may be the client: the next _SLEEPS_AFTER_SHARING waits sleep at once, as a server without polling does.
_SHARED_YIELD = 5e-6
_SLEEPS_AFTER_SHARING = 64
#: Rank 1 tries to reach rank 0 this many times, this far apart (upstream: 100 x 50 ms).
CONNECT_TRIES, CONNECT_PAUSE = 100, 0.05


def serve_connection(sock: socket.socket, core: ServerCore, poll_us: int = 0, cache: HashCache | None = None) -> str:
    """Feed ``core`` from ``sock``, send its replies and carry out its effects on ``cache`` (the one the core was
    given) until the connection ends; returns the reason.  The core is released; the socket is left to the caller.
    ``poll_us``: see :attr:`ServerConfig.poll_us`."""
    try:
        _pump(sock, core, poll_us * 1e-6, cache)
    except PeerGone as exc:
        reason = str(exc)
    except Close as exc:
        reason = f"closed: {exc}"
    except (ConnectionResetError, BrokenPipeError) as exc:
        reason = f"client reset the connection ({exc.strerror or exc})"
    except OSError as exc:
        reason = f"socket error: {exc}"
    except Exception as exc:  # a bug here must cost one connection, never the server
        log.debug("%s: internal error", core.name, exc_info=True)
        reason = f"closed: internal error {type(exc).__name__}: {exc}"
    finally:
        core.release()
    return reason


def _pump(sock: socket.socket, core: ServerCore, poll: float, cache: HashCache | None) -> None:
    chunk = bytearray(_RECV_CHUNK)
    view = memoryview(chunk)
    recv_into, next_event, receive = sock.recv_into, core.next_event, core.receive_data
    clock, yield_cpu = time.perf_counter, os.sched_yield
    blocking = sock.gettimeout() is None
    if not blocking:  # a socket with a timeout waits for data before any read, even a DONTWAIT one
        poll = 0.0
    sleep_next = 0  # waits left that sleep at once (see _SHARED_YIELD)
    bulk_spin = _BULK_SPIN if poll else 0.0

    def read(into: memoryview | bytearray) -> int:
        """recv_into ``into``, polling first (ServerConfig.poll_us says why)."""
        nonlocal sleep_next
        if sleep_next:
            sleep_next -= 1
            return recv_into(into)
        try:
            return recv_into(into, 0, _DONTWAIT)
        except BlockingIOError:
            pass
        deadline = clock() + poll
        while True:
            t = clock()
            if t > deadline:
                return recv_into(into)
            yield_cpu()
            try:
                n = recv_into(into, 0, _DONTWAIT)
            except BlockingIOError:
                continue
            if clock() - t > _SHARED_YIELD:
                # Another task ran on this CPU while it was yielded, and the bytes came meanwhile: that task was
                # likely the client, sharing this CPU.  Polling only takes time from it: sleep for a while instead.
                sleep_next = _SLEEPS_AFTER_SHARING
            return n

    if not poll:
        read = recv_into  # type: ignore[assignment]
    while True:
        out = next_event()
        if out is not None:
            if out:
                send_all(sock, out)
            continue
        effect = core.effect
        if effect is not None:  # the hash cache's blocking work, done here, off the core
            if cache is None:
                raise Close(f"the connection asked its cache for {type(effect).__name__}, but it has none")
            core.effect_done(cache.carry_out(effect))
            continue
        sink = core.bulk_ahead()
        if sink is not None:  # bulk data: straight into tensor memory (or the graph buffer)
            n = _bulk(sink, recv_into, bulk_spin) if blocking else read(sink)
            del sink  # the graph buffer may grow at the next event: no view of it may be alive then
            if n:
                core.skip(n)
                continue
            receive(b"")
            continue
        n = read(chunk)
        receive(view[:n])


def _bulk(sink: memoryview, recv_into: Callable[..., int], spin: float) -> int:
    """Fill ``sink`` from a blocking socket, a read at a time as data arrives (one MSG_WAITALL call let the client's
    sends stall: SET_TENSOR 1 MiB 0.85x of upstream 7.0.0 against 0.94x); an empty socket is retried for ``spin``
    seconds before the read sleeps (_BULK_SPIN).  Returns the bytes written: short only if the peer closed."""
    size, got, clock = sink.nbytes, 0, time.perf_counter
    while got < size:
        rest, deadline = sink[got:], clock() + spin
        while True:
            try:
                n = recv_into(rest, 0, _DONTWAIT) if spin else recv_into(rest)
                break
            except BlockingIOError:
                if clock() > deadline:
                    n = recv_into(rest)
                    break
        if not n:
            break
        got += n
    return got


def send_all(sock: socket.socket, parts: Sequence) -> None:
    """Send buffers in order without joining them: one sendmsg when the socket takes them all (the usual case)."""
    if len(parts) == 1:  # a fixed-size reply: the cheapest call
        sock.sendall(parts[0])
        return
    sent = sock.sendmsg(parts)
    if sent == sum(map(len, parts)):  # every part is a flat byte buffer: its len is its size
        return
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            sent = sock.sendmsg(views)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"peer closed the link after {got} of {n} bytes")
        got += k
    return bytes(out)


class TcpLink:
    """The servers' link of a communicator over plain TCP (:class:`.comm.Link`)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def exchange(self, data: bytes, *, send_first: bool) -> bytes:
        if send_first:
            self.sock.sendall(data)
            return _recv_exact(self.sock, len(data))
        got = _recv_exact(self.sock, len(data))
        self.sock.sendall(data)
        return got

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpLinks:
    """Opens communicator links as a server configured so (:class:`.comm.Links`): rank 0 binds the address the
    server serves on, never all interfaces; rank 1 connects only to loopback hosts unless ``comm_any_host``."""

    def __init__(self, config: ServerConfig) -> None:
        self.bind, self.timeout, self.any_host = config.comm_bind, config.comm_timeout, config.comm_any_host

    def open(self, rank: int, host: str, port: int) -> TcpLink:
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is not a TCP port")
        return TcpLink(self._listen(port) if rank == 0 else self._connect(host, port))

    def _listen(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET
        with socket.create_server((self.bind, port), family=family, backlog=1) as srv:
            srv.settimeout(self.timeout)
            try:
                link, _ = srv.accept()
            except TimeoutError:
                raise ConnectionError(f"no peer connected to {self.bind}:{port} within {self.timeout:g} s") from None
        link.settimeout(self.timeout)
        _recv_exact(link, CONN_CAPS_SIZE)  # the connector's caps first
        link.sendall(bytes(CONN_CAPS_SIZE))  # plain TCP: no transport upgrade offered
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return link

    def _connect(self, host: str, port: int) -> socket.socket:
        if not self.any_host and not _is_loopback(host):
            raise ValueError(f"peer host {host!r} is not a loopback address (the reference connects only there)")
        for _ in range(CONNECT_TRIES):
            try:
                link = socket.create_connection((host, port), timeout=self.timeout)
                break
            except OSError:
                time.sleep(CONNECT_PAUSE)
        else:
            raise ConnectionError(f"cannot reach the peer at {host}:{port}")
        link.sendall(bytes(CONN_CAPS_SIZE))
        _recv_exact(link, CONN_CAPS_SIZE)
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return link


#: How often a waiting accept() returns to the interpreter (so that SIGINT and SIGTERM are acted on).
_ACCEPT_WAKE_SECONDS = 0.2


def warm_up(on_compile: Callable[[], None] | None = None, *, load: bool = True) -> str | None:
    """Have the executor's compiled kernels ready before a server listens: compiled on this machine's first run,
    then kept in numba's cache (see :mod:`.executor.warmup`).  A first graph that waited for a compile would leave
    its client waiting past any timeout.  ``load``: load them all into this process as well (a command about to
    serve or judge); otherwise only make sure the cache holds them (a kernel then loads at its first call, in a
    fraction of a second).  Returns what it did, None when there was nothing to do.  ``on_compile``: called when a
    kernel is compiled rather than loaded (a first run)."""
    warmup = builtin_executor().warmup
    done = warmup.compile_kernels(on_compile) if load else warmup.ensure_compiled(on_compile)
    return str(done) if done is not None and done.kernels else None


class Server:
    """A listening reference server.  :meth:`serve_forever` blocks; :meth:`stop` ends it from any thread."""

    def __init__(self, config: ServerConfig, host: str = DEFAULT_HOST, port: int = 0, *, backlog: int = 16) -> None:
        # A communicator's rank 0 listens for its peer on the address this server serves on, never elsewhere.
        config = replace(config, comm_bind=host)
        self.config = config
        self.cache = HashCache(config.cache_dir, config.cache_max_bytes) if config.cache_dir else None
        if config.codebooks is not None:  # the executor is loaded only by a server that is told about codebooks
            builtin_executor().grids.use_codebooks(config.codebooks)
        if config.executor is None and config.warm_up:
            warm_up(lambda: log.info("compiling the executor's kernels for this machine before listening (once: "
                                     "later runs load them from numba's cache)"), load=False)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=backlog)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self._stopping = threading.Event()
        self._active: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        if config.threads is not None:
            limit_blas_threads(config.threads)
        if not _is_loopback(host):
            log.warning("listening on %s: the ggml RPC protocol has no authentication; anyone who can reach this "
                        "port can use the server", host)

    def serve_forever(self) -> None:
        c = self.config
        log.info("reference server for protocol %s on %s:%d (%d device(s), %d bytes each%s%s)", c.protocol.label,
                 self.host, self.port, c.devices, c.device.memory,
                 f", cache {c.cache_dir}" if c.cache_dir else "", ", concurrent" if c.concurrent else "")
        # accept() wakes every 0.2 s: a signal that lands just before the blocking call (or on another thread,
        # such as a BLAS worker) only sets the interpreter's flag, which the main thread reads when it runs again.
        self.sock.settimeout(_ACCEPT_WAKE_SECONDS)
        while not self._stopping.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    break
                # e.g. out of file descriptors: say so and back off instead of spinning
                log.warning("accept failed: %s", exc)
                self._stopping.wait(0.1)
                continue
            if self._stopping.is_set():
                conn.close()
                break
            if self.config.concurrent:
                t = threading.Thread(target=self._handle, args=(conn, peer), daemon=True)
                with self._lock:
                    self._threads.add(t)
                t.start()
            else:
                self._handle(conn, peer)

    def _handle(self, conn: socket.socket, peer: tuple) -> None:
        name = f"conn {next(self._ids)} {peer[0]}:{peer[1]}"
        with self._lock:
            self._active.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            log.info("%s: open", name)
            core = ServerCore(self.config, self.cache, name=name, links=TcpLinks(self.config))
            reason = serve_connection(conn, core, 0 if self.config.concurrent else self.config.poll_us, self.cache)
            log.info("%s: %s after %d command(s)", name, reason, core.commands)
        except Exception:  # never let one connection end the server
            log.exception("%s: unexpected error", name)
        finally:
            with self._lock:
                self._active.discard(conn)
                self._threads.discard(threading.current_thread())
            try:
                conn.close()
            except OSError:
                pass

    def stop(self) -> None:
        """Stop accepting and drop every open connection."""
        self._stopping.set()
        for s in [self.sock, *self._active]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()


class RunningServer:
    """What :func:`running_server` yields: the address (also unpackable as ``host, port``) and the server."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.host = server.host
        self.port = server.port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def protocol(self) -> Protocol:
        return self.server.config.protocol

    def __iter__(self) -> Iterator:
        return iter((self.host, self.port))


@contextmanager
def running_server(
    proto: Protocol | str | int = "7", *, host: str = DEFAULT_HOST, port: int = 0, **options: object
) -> Iterator[RunningServer]:
    """A reference server on a thread, listening on an ephemeral loopback port until the block ends.

    Options are those of :func:`.config.make_config` (devices, mem, alignment, max_size, cache_dir,
    cache_max_bytes, concurrent, verbose, max_graph_bytes, executor, threads, codebooks, hooks).
    """
    server = Server(make_config(proto, **options), host, port)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, name=f"ggml-rpc-reference:{server.port}", daemon=True)
    thread.start()
    try:
        yield RunningServer(server)
    finally:
        server.stop()
        thread.join(timeout=10)


__all__ = ["RunningServer", "Server", "TcpLink", "TcpLinks", "limit_blas_threads", "make_config", "running_server",
           "send_all", "serve_connection", "warm_up"]
