"""A capture's server side replayed in memory through the reference executor, with no server and no socket: buffers,
SET_TENSOR writes, graphs through ``build_graph`` and the executor; every GET_TENSOR reply that followed a compute
is compared (NMSE) with what the executor produced.  How the executor is held to real upstream sessions (the tests)
and what a token's graph costs it (``bench/bench_executor.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.graph import GraphTensor, build_graph
from ggml_rpc.spec import Command, Reply, Request, tensor_name, tensor_nbytes

from ..nmse import nmse
from .decode import decode_file
from .spans import as_buffer


@dataclass
class SimBuffer:
    base: int
    size: int
    memory: np.ndarray


@dataclass
class Comparison:
    """One GET_TENSOR after a compute: the tensor name, the NMSE against the captured reply and the step."""

    connection: int
    message: int
    name: str
    op: int
    nmse: float
    after: str
    #: Which compute (counted per connection, from 1) the read followed.
    compute: int
    #: The ops of that graph's nodes.
    graph_ops: frozenset[int]


@dataclass
class SimServer:
    """The memory side of one connection of an upstream server."""

    sizes: dict[int, int] = field(default_factory=dict)
    buffers: dict[int, SimBuffer] = field(default_factory=dict)
    graphs: dict[int, list[GraphTensor]] = field(default_factory=dict)
    computes: int = 0
    last_ops: frozenset[int] = frozenset()

    def _slice(self, tensor: dict, offset: int, size: int) -> np.ndarray:
        buf = self.buffers[tensor["buffer"]]
        start = tensor["data"] - buf.base + offset
        assert 0 <= start and start + size <= buf.size
        return buf.memory[start : start + size]

    def handle(self, req: Request, rep: Reply | None) -> np.ndarray | None:
        """Apply one request; returns the server's bytes for a GET_TENSOR."""
        cmd, f = req.command, req.fields
        if cmd is Command.ALLOC_BUFFER and rep is not None and rep.fields["remote_ptr"]:
            self.sizes[rep.fields["remote_ptr"]] = rep.fields["remote_size"]
        elif cmd is Command.BUFFER_GET_BASE and rep is not None:
            handle = f["remote_ptr"]
            size = self.sizes[handle]
            self.buffers[handle] = SimBuffer(rep.fields["base_ptr"], size, np.zeros(size, dtype=np.uint8))
        elif cmd is Command.FREE_BUFFER:
            self.buffers.pop(f["remote_ptr"], None)
            self.graphs.clear()
        elif cmd is Command.BUFFER_CLEAR:
            self.buffers[f["remote_ptr"]].memory[:] = f["value"]
        elif cmd is Command.SET_TENSOR:
            data = np.frombuffer(as_buffer(req.data), dtype=np.uint8)
            self._slice(f["tensor"], f["offset"], data.size)[:] = data
        elif cmd is Command.MEMSET_TENSOR:
            self._slice(f["tensor"], f["offset"], f["size"])[:] = f["value"]
        elif cmd is Command.COPY_TENSOR:
            if rep is not None and rep.fields["result"]:
                size = tensor_nbytes(f["src"])
                self._slice(f["dst"], 0, size)[:] = self._slice(f["src"], 0, size)
        elif cmd is Command.GRAPH_COMPUTE:
            graph = build_graph(f["nodes"], f["tensors"], self.buffers)
            self.graphs[f["device"]] = graph.nodes
            self.last_ops = frozenset(n.op for n in graph.nodes)
            execute(graph.nodes)
            self.computes += 1
        elif cmd is Command.GRAPH_RECOMPUTE:
            execute(self.graphs[f["device"]])
            self.computes += 1
        elif cmd is Command.GET_TENSOR:
            return self._slice(f["tensor"], f["offset"], f["size"])
        return None


def replay(path: str | Path) -> list[Comparison]:
    """Every GET_TENSOR that followed a compute, compared (as F32) with the captured reply."""
    out: list[Comparison] = []
    for dc in decode_file(path):
        assert dc.error is None
        sim = SimServer()
        msgs = list(dc.messages())
        last = ""
        for i, msg in enumerate(msgs):
            if isinstance(msg, Reply):
                continue
            rep = msgs[i + 1] if i + 1 < len(msgs) and isinstance(msgs[i + 1], Reply) else None
            if msg.command in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                last = msg.command.name
            got = sim.handle(msg, rep)
            if got is not None and last and rep is not None:
                want = np.frombuffer(as_buffer(rep.data), dtype=np.float32)
                t = msg.fields["tensor"]
                out.append(Comparison(dc.conn.index, i, tensor_name(t["name"]), t["op"],
                                      nmse(want, got.view(np.float32)), last, sim.computes, sim.last_ops))
    return out


__all__ = ["Comparison", "SimBuffer", "SimServer", "replay"]
