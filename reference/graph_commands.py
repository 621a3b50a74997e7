"""The reference connection's graph commands: GRAPH_COMPUTE (received as it arrives, rebuilt only when it changed)
and GRAPH_RECOMPUTE, run by the built-in executor or the configured one.  The group owns the connection's stored
graphs; it is given the buffer table and the resolver (for the device checks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from types import ModuleType
from typing import Any

import numpy as np
from ggml_rpc.spec import Command, Payload, ProtocolError, tensor_name
from ggml_rpc.spec.codec import decode_payload

from .closing import SIZE_LIMIT, Close, Wait
from .closing import upstream as _upstream
from .config import ServerConfig
from .devices import BufferTable
from .graph import BuiltGraph, ExecutorError, GraphError, GraphTensor, build_graph
from .resolve import Resolver, Tensor

log = logging.getLogger("ggml_rpc.reference")

_GRAPH_CHUNK = 1 << 20


class GraphCommands:
    """GRAPH_COMPUTE and GRAPH_RECOMPUTE, and the graphs they store."""

    def __init__(self, config: ServerConfig, table: BufferTable, resolve: Resolver, *, name: str) -> None:
        self.config = config
        self.protocol = config.protocol
        self.table = table
        self.resolve = resolve
        self.name = name
        self._executor = config.executor
        #: Stored graphs by (device, uid); uid is 0 before 8.0.0, where a device keeps only its last graph.
        self.graphs: dict[tuple[int, int], BuiltGraph | None] = {}
        #: GRAPH_COMPUTE payloads are received here (grown as bytes arrive, reused by the next one).
        self._graph_buf = bytearray()
        self.handlers: dict[Command, Callable[[dict[str, Any]], None]] = {Command.GRAPH_RECOMPUTE: self.recompute}

    def forget_buffer(self, handle: int) -> None:
        """A FREE_BUFFER of ``handle``: what the version does to the stored graphs."""
        if self.protocol.graph_cache_max is not None:
            # 8.0.0 forgets every stored graph on any FREE_BUFFER, keeping their uids (they still count towards
            # GRAPH_CACHE_MAX): a GRAPH_RECOMPUTE after it closes, a GRAPH_COMPUTE under the uid rebuilds.
            self.graphs = dict.fromkeys(self.graphs)
            return
        # Upstream 6/7 keeps stored graphs that point into the freed buffer (a use-after-free on RECOMPUTE).
        for key, graph in list(self.graphs.items()):
            if graph is not None and handle in graph.buffers:
                del self.graphs[key]
                log.info("%s: FREE_BUFFER %#x drops the stored graph of device %d", self.name, handle, key[0])

    def _receive_growing(self, size: int) -> Generator:
        """``size`` bytes (the receiver's result), into the connection's graph receive buffer, which grows as bytes
        arrive (never on a mere claim) and is kept for the next GRAPH_COMPUTE: a client sends the same large graph
        every token, and growing a fresh buffer each time cost more than receiving it (3 MB: 3.0 ms against 0.6 ms)."""
        self._grow_graph_buf(min(size, _GRAPH_CHUNK))
        got = 0
        while got < size:
            if got == len(self._graph_buf):
                self._grow_graph_buf(min(2 * got, size))
            end = min(len(self._graph_buf), size)
            view = memoryview(self._graph_buf)[got:end]
            yield Wait(view, lambda k, got=got: f"client closed the connection inside a GRAPH_COMPUTE ({got + k} of "
                                                f"{size} bytes)")
            del view  # the buffer may grow next: no view of it may be alive then
            got = end
        return memoryview(self._graph_buf)[:size]

    def _grow_graph_buf(self, size: int) -> None:
        buf = self._graph_buf
        if len(buf) >= size:
            return
        try:
            buf.extend(bytes(size - len(buf)))
        except BufferError:  # a view of it is still alive somewhere: start a new one
            self._graph_buf = buf + bytes(size - len(buf))

    def compute(self, payload: Payload, size: int) -> Generator:
        if size >= SIZE_LIMIT:
            raise Close(f"GRAPH_COMPUTE size {size} >= 2^63{_upstream('process abort, uncaught length error')}")
        if size > self.config.max_graph_bytes:
            raise Close(f"GRAPH_COMPUTE size {size} above the server's limit {self.config.max_graph_bytes}"
                        f"{_upstream('allocates the claim')}")
        body = yield from self._receive_growing(size)
        try:
            fields, _trailing = decode_payload(payload, body, command="GRAPH_COMPUTE")
        except ProtocolError as exc:
            raise Close(f"GRAPH_COMPUTE: {exc.message}{_upstream('close')}") from None
        device = self.resolve.device(fields["device"], "GRAPH_COMPUTE")
        key = self._graph_key(device, fields)
        graph = self.graphs.get(key) if key is not None else None
        # The very graph stored for this device, sent again (what a client without GRAPH_RECOMPUTE does every
        # token): rebuilding would give the same graph, since every buffer it uses is still there (a FREE_BUFFER
        # drops it) and every handle it named unknown still is.  Its prepared plan runs again.
        if graph is None or graph.source != body or any(h in self.table.buffers for h in graph.unknown):
            # A copy of its own: the receive buffer is overwritten by the next GRAPH_COMPUTE.
            source = bytearray(body)
            fields, _trailing = decode_payload(payload, memoryview(source), command="GRAPH_COMPUTE")
            try:
                graph = build_graph(fields["nodes"], fields["tensors"], self.table.buffers)
            except GraphError as exc:
                raise Close(f"GRAPH_COMPUTE: {exc}", exc.rule) from None
            # The payload is kept only while it is not much larger than the graph itself: one that is mostly
            # unreached tensors must not stay allocated for as long as the graph does.
            if 2 * graph.n_tensors >= len(fields["tensors"]):
                graph.source = source
        del fields, body  # no view of the receive buffer outlives the request
        if key is not None:
            limit = self.protocol.graph_cache_max
            if limit is not None and key not in self.graphs and sum(k[0] == device for k in self.graphs) >= limit:
                # 8.0.0: a device holding GRAPH_CACHE_MAX graphs forgets them all before it keeps another (the
                # client counts alike, so it sends those graphs again rather than recompute them).
                for k in [k for k in self.graphs if k[0] == device]:
                    del self.graphs[k]
            self.graphs[key] = graph
        self._run(graph, "GRAPH_COMPUTE")

    def _graph_key(self, device: int, fields: dict[str, Any]) -> tuple[int, int] | None:
        """Where a graph is kept: per device (6.0.0, 7.0.x: the last one); per (device, uid) from 8.0.0, where
        uid 0 is not kept at all."""
        if self.protocol.graph_cache_max is None:
            return (device, 0)
        uid = fields["uid"]
        return (device, uid) if uid else None

    def recompute(self, f: dict[str, Any]) -> None:
        device = self.resolve.device(f["device"], "GRAPH_RECOMPUTE")
        key = self._graph_key(device, f)
        graph = self.graphs.get(key) if key is not None else None
        if graph is None:
            which = f"uid {f['uid']}" if "uid" in f else f"device {device}"
            raise Close(f"GRAPH_RECOMPUTE: no stored graph for {which} (none computed, or a buffer it used was "
                        f"freed){_upstream('close; 6/7 after FREE_BUFFER a use-after-free')}")
        self._run(graph, "GRAPH_RECOMPUTE")

    def _run(self, graph: BuiltGraph, command: str) -> None:
        try:
            if self._executor is None:
                # The built-in executor: prepared once per graph (views, kernels, shape checks), so a
                # GRAPH_RECOMPUTE only runs kernels.
                if graph.plan is None:
                    try:
                        executor = builtin_executor()
                    except ImportError as exc:
                        raise Close(f"{command}: graph executor unavailable ({exc})") from None
                    # Computed as the upstream build of the version this server speaks.
                    graph.plan = executor.prepare(graph.nodes, executor.build_for(self.protocol.version[0]))
                try:
                    graph.plan.run(self._epochs(graph))
                finally:
                    self._bump(graph, graph.plan.written)
            else:
                try:
                    self._executor(graph.nodes)
                finally:
                    self._bump(graph, None)
        except ExecutorError as exc:
            raise Close(f"{command}: executor refused the graph: {exc}") from None
        except Close:
            raise
        except Exception as exc:
            log.debug("%s: executor failure", self.name, exc_info=True)
            raise Close(f"{command}: executor failed ({type(exc).__name__}: {exc})"
                        f"{_upstream('process abort on backend failure')}") from None

    def _epochs(self, graph: BuiltGraph) -> dict[int, int]:
        """Write epochs of the graph's buffers, keyed as the executor names a buffer (the id of its memory array)."""
        table = self.table.buffers
        return {id(b.memory): b.epoch for h in graph.buffers if (b := table.get(h)) is not None}

    def _bump(self, graph: BuiltGraph, written: frozenset[int] | None) -> None:
        """A run wrote into the buffers of its nodes (``written``: their memory arrays' ids; None: any of them)."""
        table = self.table.buffers
        for h in graph.buffers:
            b = table.get(h)
            if b is not None and (written is None or id(b.memory) in written):
                b.written()

def builtin_executor() -> ModuleType:
    """The built-in executor (:mod:`ggml_rpc.reference.executor`), imported on first use."""
    # Lazy on purpose, the reference's one import of its executor: the executor imports numba and reads its compiled
    # kernels' cache (about a second), which a server that never computes a graph (the harness's, the fuzzer's
    # oracle, a test's) does not pay.
    from . import executor

    return executor


def executor_supports(op: Tensor, srcs: list[Tensor | None], name: str) -> bool:
    """Ask the executor whether it runs this op; an executor that cannot say answers no (``name``: the connection,
    for the log)."""
    try:
        executor = builtin_executor()
    except ImportError:
        return False
    supports = getattr(executor, "supports_op", None)
    if supports is None:
        return False
    node = _single_graph_tensor(op)
    node.src = [_single_graph_tensor(s) if s is not None else None for s in srcs]
    try:
        return bool(supports(node))
    except Exception:
        log.debug("%s: supports_op failed", name, exc_info=True)
        return False


def _single_graph_tensor(t: Tensor) -> GraphTensor:
    f = t.fields
    assert f is not None  # the supports_op path decodes its tensors to dicts
    buf = t.buffer
    return GraphTensor(
        id=f["id"],
        type=f["type"],
        ne=tuple(f["ne"]),
        nb=tuple(f["nb"]),
        op=f["op"],
        op_params=np.array(f["op_params"], dtype=np.int32),
        flags=f["flags"],
        view_offs=f["view_offs"],
        data=f["data"],
        name=tensor_name(f["name"]),
        use_count=f["use_count"],
        buffer=buf.view() if buf is not None else None,
        offset=f["data"] - buf.base if buf is not None else 0,
        nbytes=t.nbytes,
    )


__all__ = ["GraphCommands", "builtin_executor", "executor_supports"]
