"""The reference server's accept loop, and an in-process server for tests, the harness and benchmarks.

Like upstream, one connection is served at a time: the accept loop runs the connection itself, so a second client
waits in the listen backlog until the first leaves.  ``concurrent`` serves each connection on its own thread
(for test farms); connections then share nothing but the hash cache.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from ggml_rpc.spec import DEFAULT_HOST, Protocol, parse_version_option

from .cache import HashCache
from .connection import Connection, ServerConfig
from .devices import DeviceConfig
from .graph import GraphTensor

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


class Server:
    """A listening reference server.  :meth:`serve_forever` blocks; :meth:`stop` ends it from any thread."""

    def __init__(self, config: ServerConfig, host: str = DEFAULT_HOST, port: int = 0, *, backlog: int = 16) -> None:
        # A communicator's rank 0 listens for its peer on the address this server serves on, never elsewhere.
        config = replace(config, comm_bind=host)
        self.config = config
        self.cache = HashCache(config.cache_dir, config.cache_max_bytes) if config.cache_dir else None
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
        while not self._stopping.is_set():
            try:
                conn, peer = self.sock.accept()
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
            handler = Connection(conn, self.config, self.cache, name=name)
            reason = handler.serve()
            log.info("%s: %s after %d command(s)", name, reason, handler.commands)
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


def make_config(
    proto: Protocol | str | int = "7",
    *,
    devices: int = 1,
    mem: int | None = None,
    alignment: int | None = None,
    max_size: int | None = None,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    concurrent: bool = False,
    verbose: bool = False,
    max_graph_bytes: int | None = None,
    executor: Callable[[list[GraphTensor]], None] | None = None,
    threads: int | None = 1,
) -> ServerConfig:
    """A ServerConfig from plain options (``proto``: a Protocol or a label such as ``6``, ``7``, ``7.0.1``)."""
    protocol = proto if isinstance(proto, Protocol) else parse_version_option(str(proto))
    dev = DeviceConfig()
    dev = replace(
        dev,
        memory=dev.memory if mem is None else mem,
        alignment=dev.alignment if alignment is None else alignment,
        max_size=dev.max_size if max_size is None else max_size,
    )
    config = ServerConfig(protocol=protocol, devices=devices, device=dev, cache_dir=cache_dir,
                          cache_max_bytes=cache_max_bytes, concurrent=concurrent, verbose=verbose, executor=executor,
                          threads=threads)
    if max_graph_bytes is not None:
        config = replace(config, max_graph_bytes=max_graph_bytes)
    return config


@contextmanager
def running_server(
    proto: Protocol | str | int = "7", *, host: str = DEFAULT_HOST, port: int = 0, **options: object
) -> Iterator[RunningServer]:
    """A reference server on a thread, listening on an ephemeral loopback port until the block ends.

    Options are those of :func:`make_config` (devices, mem, alignment, max_size, cache_dir, cache_max_bytes,
    concurrent, verbose, max_graph_bytes, executor, threads).
    """
    server = Server(make_config(proto, **options), host, port)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, name=f"ggml-rpc-reference:{server.port}", daemon=True)
    thread.start()
    try:
        yield RunningServer(server)
    finally:
        server.stop()
        thread.join(timeout=10)
