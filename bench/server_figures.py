"""The server figures of ``ggml-rpc bench``: bulk transfers, round trips, a big graph, cache hits.

Every measurement talks to its target through :class:`~ggml_rpc.conformance.client.RpcClient` on a connection of
its own, opened in ``prepare`` (HELLO first: the version the server announces decides the layouts) and closed in
``finish``, so that a server that serves one connection at a time (upstream, the reference by default) is free
again for the next figure.  Buffers are allocated with ALLOC_BUFFER and addressed through BUFFER_GET_BASE like a
real client does, and freed before the connection closes.

SET_TENSOR has no reply: a batch of them is timed up to the reply of one GET_ALIGNMENT sent after the batch, which
the server can only answer once it has read (and stored) every byte before it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.spec import (
    TENSOR_DTYPE,
    GgmlOp,
    GgmlType,
    Protocol,
    TensorFlag,
    fnv1a64,
    make_tensor,
)

from .placement import client_on, listener_pid, placed, usable_cpus
from .runner import Figure, Measurement, NotApplicable, timed

KIB, MIB = 1 << 10, 1 << 20
_F32 = int(GgmlType.F32)


@dataclass
class BenchTarget:
    """A server to measure: where it is and what its HELLO said."""

    name: str
    host: str
    port: int
    description: str = ""
    version: tuple[int, int, int] | None = None
    protocol: Protocol | None = None
    #: Cache directory of a server the bench started itself (None for an external server: unknown).
    cache_dir: str | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def connect(self, timeout: float = 60.0) -> RpcClient:
        """A new connection; HELLO learns the version (and the first one records it here)."""
        client = RpcClient.connect(self.host, self.port, timeout=timeout)
        if self.version is None:
            self.version, self.protocol = client.server_version, client.protocol
        return client

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "description": self.description,
                "version": ".".join(map(str, self.version)) if self.version else None, "cache_dir": self.cache_dir}


def size_label(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _size_key(n: int) -> str:
    return size_label(n).replace(" ", "")


@dataclass
class _Conn:
    """A connection with one buffer of ``size`` bytes and a byte tensor covering it."""

    client: RpcClient
    handle: int = 0
    base: int = 0
    tensor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _open_with_buffer(target: BenchTarget, size: int, ne: tuple[int, ...] | None = None) -> _Conn:
    client = target.connect()
    try:
        handle, got = client.alloc_buffer(0, size)
        if handle == 0 or got < size:
            raise NotApplicable(f"the server could not allocate a {size_label(size)} buffer")
        base = client.buffer_get_base(handle)
    except BaseException:
        client.close()
        raise
    tensor = make_tensor(id=0x1000, type=int(GgmlType.I8), ne=ne or (size,), buffer=handle, data=base, name="bench")
    return _Conn(client, handle, base, tensor)


def _close(conn: _Conn) -> None:
    try:
        if conn.handle:
            # Cleanup never waits long: interrupted, the server (in the kit's process group) is stopping too and
            # may hold the connection without answering; closing it frees the buffer anyway.
            conn.client.sock.settimeout(0.5)
            conn.client.free_buffer(conn.handle)
            conn.client.get_alignment(0)  # FREE_BUFFER has no reply: wait until the server has done it
    except Exception:  # the connection may already be gone; closing it frees the buffer anyway
        pass
    finally:
        conn.client.close()


def _pattern(size: int, seed: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class _Transfer(Measurement[_Conn]):
    """``batch`` transfers of ``size`` bytes per sample, to/from one tensor; the value is MB/s (10^6 bytes)."""

    def __init__(self, size: int, batch: int, goal: tuple[str, float, str] | None = None) -> None:
        self.size, self.batch = size, batch
        self.goal = goal

    def prepare(self, target: BenchTarget) -> _Conn:
        conn = _open_with_buffer(target, self.size)
        conn.extra["data"] = _pattern(self.size)
        conn.extra["out"] = memoryview(bytearray(self.size))
        return conn

    def finish(self, state: _Conn) -> None:
        _close(state)


class SetTensor(_Transfer):
    def __init__(self, size: int, batch: int, goal: tuple[str, float, str] | None = None) -> None:
        super().__init__(size, batch, goal)
        self.figure = Figure(f"set_tensor_{_size_key(size)}", f"SET_TENSOR {size_label(size)}", "MB/s", goal=goal)

    def sample(self, state: _Conn) -> float:
        c, t, data = state.client, state.tensor, state.extra["data"]

        def run() -> None:
            for _ in range(self.batch):
                c.set_tensor(t, 0, data)
            c.get_alignment(0)

        return self.size * self.batch / timed(run) / 1e6

    def prepare(self, target: BenchTarget) -> _Conn:
        conn = super().prepare(target)
        # Checked once (untimed): the bytes really arrived, so the figure is one of a working transfer.
        conn.client.set_tensor(conn.tensor, 0, conn.extra["data"])
        back = conn.client.get_tensor(conn.tensor, 0, self.size)
        if back != conn.extra["data"].tobytes():
            raise RuntimeError("GET_TENSOR did not return the bytes SET_TENSOR sent")
        return conn


class GetTensor(_Transfer):
    def __init__(self, size: int, batch: int, goal: tuple[str, float, str] | None = None) -> None:
        super().__init__(size, batch, goal)
        self.figure = Figure(f"get_tensor_{_size_key(size)}", f"GET_TENSOR {size_label(size)}", "MB/s", goal=goal)

    def prepare(self, target: BenchTarget) -> _Conn:
        conn = super().prepare(target)
        conn.client.set_tensor(conn.tensor, 0, conn.extra["data"])
        conn.client.get_tensor_into(conn.tensor, 0, conn.extra["out"])
        if conn.extra["out"] != conn.extra["data"].data:
            raise RuntimeError("GET_TENSOR did not return the bytes SET_TENSOR sent")
        return conn

    def sample(self, state: _Conn) -> float:
        c, t, out = state.client, state.tensor, state.extra["out"]

        def run() -> None:
            for _ in range(self.batch):
                c.get_tensor_into(t, 0, out)

        return self.size * self.batch / timed(run) / 1e6


@dataclass
class _Placed:
    client: RpcClient
    placement: contextlib.ExitStack


class RoundTrips(Measurement[_Placed]):
    """GET_ALIGNMENT request/reply pairs per second (the smallest command with a reply), with client and server on
    one CPU (``cpus`` 1: what the server costs per command) or on two (``cpus`` 2: plus waking each other across
    CPUs).  ``bench/placement.py`` says why the placement is chosen rather than left to the scheduler."""

    def __init__(self, count: int, cpus: int = 1, goal: tuple[str, float, str] | None = None) -> None:
        if cpus not in (1, 2):
            raise ValueError("round trips are placed on one CPU or two")
        self.count, self.cpus = count, cpus
        where = "one CPU" if cpus == 1 else "two CPUs"
        self.figure = Figure(f"round_trips_{cpus}cpu", f"small round trips (GET_ALIGNMENT), {where}",
                             "round trips/s", goal=goal)

    def prepare(self, target: BenchTarget) -> _Placed:
        cpus = usable_cpus()
        if len(cpus) < self.cpus:
            raise NotApplicable(f"this process may use {len(cpus)} CPU(s)")
        pid = listener_pid(target.port)
        if pid is None:
            raise NotApplicable(f"no process listening on port {target.port} is visible here: it cannot be placed")
        stack = contextlib.ExitStack()
        server_cpu = cpus[0] if self.cpus == 1 else cpus[1]
        try:
            stack.enter_context(placed(pid, {server_cpu}))
        except PermissionError as exc:
            raise NotApplicable(f"cannot place the server's process {pid}: {exc.strerror or exc}") from None
        try:
            return _Placed(target.connect(), stack)
        except BaseException:
            stack.close()
            raise

    def sample(self, state: _Placed) -> float:
        get_alignment = state.client.get_alignment

        def run() -> None:
            for _ in range(self.count):
                get_alignment(0)

        # The client on the first usable CPU for the sample only: between samples the bench runs as it was started.
        with client_on({usable_cpus()[0]}):
            get_alignment(0)  # the first call after moving is not timed: it pays for the migration
            return self.count / timed(run)

    def finish(self, state: _Placed) -> None:
        try:
            state.client.close()
        finally:
            state.placement.close()


#: Tensor ids as a real client sends them: addresses of its own tensor structs (sparse 64-bit values, so lookups
#: by id cost what they cost in a real session; small consecutive ids would flatter a server's or decoder's lookups).
CHAIN_ID_BASE = 0x55D0_4C00_0000
CHAIN_ID_STRIDE = 0x150


def chain_graph(n_tensors: int, handle: int, base: int, width: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """A trivial graph of ``n_tensors`` F32 tensors of ``width`` elements: x and c, then x_{i+1} = x_i + c.

    Returns (node ids, tensors) ready for GRAPH_COMPUTE; tensor k lives at ``base + k * 4 * width``.
    """
    if n_tensors < 3:
        raise ValueError("a chain needs at least 3 tensors")
    row = 4 * width
    tensors = np.zeros(n_tensors, dtype=TENSOR_DTYPE)
    ids = np.uint64(CHAIN_ID_BASE) + np.arange(n_tensors, dtype=np.uint64) * np.uint64(CHAIN_ID_STRIDE)
    tensors["id"] = ids
    tensors["type"] = _F32
    tensors["buffer"] = handle
    tensors["ne"] = [width, 1, 1, 1]
    tensors["nb"] = [4, row, row, row]
    tensors["data"] = np.uint64(base) + np.arange(n_tensors, dtype=np.uint64) * np.uint64(row)
    tensors["op"][2:] = int(GgmlOp.ADD)
    tensors["flags"][2:] = int(TensorFlag.COMPUTE)
    tensors["src"][2:, 0] = ids[1:-1]  # node k adds node k-1 and c ...
    tensors["src"][2, 0] = ids[0]  # ... and the first node adds x and c
    tensors["src"][2:, 1] = ids[1]
    tensors["use_count"][:-1] = 1
    return ids[2:].copy(), tensors


class GraphCompute(Measurement[_Conn]):
    """GRAPH_COMPUTE of a chain of ``n_tensors`` tensors and the read of its result, in milliseconds.

    The result is checked (x = c = 1, so the last node holds 1 + number of ADDs): a wrong server is an error.
    """

    def __init__(self, n_tensors: int, width: int = 16, goal: tuple[str, float, str] | None = None) -> None:
        self.n, self.width = n_tensors, width
        self.figure = Figure(f"graph_compute_{n_tensors}", f"GRAPH_COMPUTE {n_tensors:,} tensors + read", "ms",
                             higher_is_better=False, goal=goal)

    def prepare(self, target: BenchTarget) -> _Conn:
        row = 4 * self.width
        conn = _open_with_buffer(target, self.n * row)
        nodes, tensors = chain_graph(self.n, conn.handle, conn.base, self.width)
        ones = np.ones(2 * self.width, dtype=np.float32)
        conn.client.set_tensor(conn.tensor, 0, ones)  # x and c are the buffer's first two rows
        last = make_tensor(id=int(tensors["id"][-1]), type=_F32, ne=(self.width,), buffer=conn.handle,
                           data=conn.base + (self.n - 1) * row)
        conn.extra.update(nodes=nodes, tensors=tensors, last=last, out=memoryview(bytearray(row)),
                          want=np.full(self.width, 1.0 + len(nodes), dtype=np.float32))
        return conn

    def sample(self, state: _Conn) -> float:
        c, e = state.client, state.extra
        e["out"][:] = bytes(len(e["out"]))

        def run() -> None:
            c.graph_compute(0, e["nodes"], e["tensors"])
            c.get_tensor_into(e["last"], 0, e["out"])

        seconds = timed(run)
        got = np.frombuffer(e["out"], dtype=np.float32)
        if not np.array_equal(got, e["want"]):
            raise RuntimeError(f"wrong graph result: {got[0]} instead of {e['want'][0]}")
        return seconds * 1e3

    def finish(self, state: _Conn) -> None:
        _close(state)


class HashHit(Measurement[_Conn]):
    """SET_TENSOR_HASH answered from the server's cache, in milliseconds (the server fills ``size`` bytes).

    The cache is primed the way the target's version saves payloads (spec/PROTOCOL.md#v7-cache-rule: v7 a SET_TENSOR
    with cache_flag set, v6 any SET_TENSOR above 10 MiB).  The content is the same on every run, so repeated runs reuse
    one cache entry instead of filling the server's cache directory.  A server that still answers "miss" after priming
    has no cache: the figure is n/a there.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.figure = Figure("set_tensor_hash_hit", f"SET_TENSOR_HASH hit {size_label(size)}", "ms",
                             higher_is_better=False)

    def prepare(self, target: BenchTarget) -> _Conn:
        conn = _open_with_buffer(target, self.size)
        try:
            c = conn.client
            assert c.protocol is not None
            data = _pattern(self.size, seed=0x6767)
            rule = c.protocol.cache_rule
            if rule.flag_field is None and (rule.save_above is None or self.size <= rule.save_above):
                raise NotApplicable(f"protocol {c.protocol.label} saves only payloads above {rule.save_above} bytes")
            digest = fnv1a64(data)
            if not c.set_tensor_hash(conn.tensor, 0, digest):
                c.set_tensor(conn.tensor, 0, data, cache_flag=1 if rule.flag_field else 0)
                c.get_alignment(0)
                if not c.set_tensor_hash(conn.tensor, 0, digest):
                    raise NotApplicable("no cache hit after priming: the server has no cache (upstream: start "
                                        "rpc-server with -c)")
            conn.extra["digest"] = digest
            # The hit must have filled the tensor with the cached bytes.
            c.buffer_clear(conn.handle, 0)
            c.set_tensor_hash(conn.tensor, 0, digest)
            if c.get_tensor(conn.tensor, 0, self.size) != data.tobytes():
                raise RuntimeError("a cache hit did not fill the tensor with the cached bytes")
        except BaseException:
            _close(conn)
            raise
        return conn

    def sample(self, state: _Conn) -> float:
        c, t, digest = state.client, state.tensor, state.extra["digest"]
        hit = False

        def run() -> None:
            nonlocal hit
            hit = c.set_tensor_hash(t, 0, digest)

        ms = timed(run) * 1e3
        if not hit:
            raise RuntimeError("the cache entry disappeared during the run (SET_TENSOR_HASH answered miss)")
        return ms

    def finish(self, state: _Conn) -> None:
        _close(state)


__all__ = [
    "CHAIN_ID_BASE",
    "CHAIN_ID_STRIDE",
    "BenchTarget",
    "GetTensor",
    "GraphCompute",
    "HashHit",
    "RoundTrips",
    "SetTensor",
    "chain_graph",
    "size_label",
]
