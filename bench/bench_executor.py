"""Benchmarks of the reference graph executor (a script, not a test): prints figures and the targets.

    python bench/bench_executor.py

1. F32 MUL_MAT 4096x4096 by 4096x32 through the executor vs plain numpy matmul (target >= 50%).
2. Q4_0 / Q8_0 / Q4_K dequantisation throughput (target >= 200 M weights/s).
3. Per-token GRAPH_RECOMPUTE of the 2-layer model in the real v7 capture, run as the server runs it (a plan
   prepared at the GRAPH_COMPUTE, run again per token; target <= 20 ms).
4. A GRAPH_COMPUTE of 2,000 chained small F32 ADDs plus the read of the result (target <= 20 ms): graph building,
   plan preparation and plan runs alone (CPU time), and end to end over loopback TCP against the reference
   server: a new graph each time, the same graph sent again, and GRAPH_RECOMPUTE.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ggml_rpc.bench.runner import samples
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.executor_replay import SimServer
from ggml_rpc.reference.executor import execute, prepare
from ggml_rpc.reference.executor.arena import Arena
from ggml_rpc.reference.executor.types import dequantize, quantize
from ggml_rpc.reference.graph import build_graph
from ggml_rpc.reference.server import running_server
from ggml_rpc.spec import TYPES, Command, GgmlOp, GgmlType, Reply, TensorFlag, make_tensor, tensors_array

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT.parent / "shared" / "real-captures" / "v7-v7-gen-cold.pcap"


def median_time(fn: Callable[[], object], repeat: int = 7) -> float:
    """Median wall time of ``fn`` in seconds, after one warm-up call."""
    fn()
    return statistics.median(samples(fn, repeat))


def bench_matmul() -> None:
    rng = np.random.default_rng(0)
    k, m, n = 4096, 4096, 32
    arena = Arena(4 * (k * m + k * n + m * n) + 1024)
    a = arena.tensor(GgmlType.F32, (k, m))
    b = arena.tensor(GgmlType.F32, (k, n))
    out = arena.tensor(GgmlType.F32, (m, n), op=GgmlOp.MUL_MAT, src=(a, b))
    arena.raw(a)[...] = rng.standard_normal((1, 1, m, k), dtype=np.float32)
    arena.raw(b)[...] = rng.standard_normal((1, 1, n, k), dtype=np.float32)
    wa, wb = arena.raw(a)[0, 0].copy(), arena.raw(b)[0, 0].copy()
    t_exec = median_time(lambda: execute([out]))
    t_np = median_time(lambda: wb @ wa.T)
    print(f"MUL_MAT F32 {m}x{k} by {k}x{n}: executor {t_exec * 1e3:.1f} ms, numpy {t_np * 1e3:.1f} ms, "
          f"executor at {100 * t_np / t_exec:.0f}% of numpy (target >= 50%)")


def bench_dequant() -> None:
    rng = np.random.default_rng(1)
    n_weights = 4096 * 4096
    for name in ("Q4_0", "Q8_0", "Q4_K"):
        t = int(getattr(GgmlType, name))
        info = TYPES[t]
        n_blocks = n_weights // info.blck
        if name == "Q4_K":
            blocks = rng.integers(0, 256, size=(n_blocks, info.size), dtype=np.uint8)
            d = rng.uniform(1e-3, 1e-2, size=(n_blocks, 2)).astype("<f2").view(np.uint8)
            blocks[:, 0:4] = d.reshape(n_blocks, 4)
        else:
            x = rng.standard_normal(n_weights, dtype=np.float32).reshape(-1, 4096)
            blocks = quantize(t, x).reshape(n_blocks, info.size)
        secs = median_time(lambda t=t, blocks=blocks: dequantize(t, blocks), repeat=5)
        print(f"dequantise {name}: {n_weights / secs / 1e6:.0f} M weights/s (target >= 200)")


def cpu_best(fn: Callable[[], object], repeat: int = 15) -> float:
    """Least CPU time (seconds) of ``fn`` over ``repeat`` calls after a warm-up: what other processes on a shared
    machine do not inflate."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def bench_capture() -> None:
    if not CAPTURE.exists():
        print(f"per-token graph: skipped ({CAPTURE} not found)")
        return
    @dataclass
    class PlanServer(SimServer):
        """The capture replayed as the reference server runs graphs: prepared once, run again on RECOMPUTE."""

        plans: dict = field(default_factory=dict)

        def handle(self, req, rep):  # type: ignore[no-untyped-def]
            if req.command is Command.GRAPH_RECOMPUTE:
                self.plans[req.fields["device"]].run()
                self.computes += 1
                return None
            out = super().handle(req, rep)
            if req.command is Command.GRAPH_COMPUTE:
                # (the replay helper already ran it once; the plan is what a later RECOMPUTE runs)
                self.plans[req.fields["device"]] = prepare(self.graphs[req.fields["device"]])
            elif req.command is Command.FREE_BUFFER:
                self.plans.clear()
            return out

    dc = decode_file(CAPTURE)[-1]
    msgs = list(dc.messages())
    best: list[float] | None = None
    for _ in range(3):
        sim = PlanServer()
        per_token: list[float] = []
        for i, msg in enumerate(msgs):
            if isinstance(msg, Reply):
                continue
            rep = msgs[i + 1] if i + 1 < len(msgs) and isinstance(msgs[i + 1], Reply) else None
            if msg.command in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                t0 = time.process_time()
                sim.handle(msg, rep)
                per_token.append(time.process_time() - t0)
            else:
                sim.handle(msg, rep)
        best = per_token if best is None else [min(a, b) for a, b in zip(best, per_token, strict=True)]
    assert best is not None
    tokens = best[2:]  # the warm-up and the 2-token prompt are not single-token steps
    print(f"per-token GRAPH_RECOMPUTE of the capture's model ({len(tokens)} tokens, CPU, best of 3): median "
          f"{statistics.median(tokens) * 1e3:.1f} ms, max {max(tokens) * 1e3:.1f} ms (target <= 20 ms); "
          f"first GRAPH_COMPUTE (build + run + prepare) {best[0] * 1e3:.1f} ms")


def _chain(n: int, width: int) -> tuple[list[dict], list[int], int]:
    """rpc_tensor dicts of x_{i+1} = x_i + c (one buffer, handle 1, base 0x1000), the node ids, the result offset."""
    f32 = int(GgmlType.F32)
    size = 4 * width
    tensors = [make_tensor(id=1, type=f32, ne=(width,), buffer=1, data=0x1000, name="x0"),
               make_tensor(id=2, type=f32, ne=(width,), buffer=1, data=0x1000 + size, name="c")]
    nodes = []
    prev = 1
    for i in range(n):
        tid = 3 + i
        tensors.append(make_tensor(id=tid, type=f32, ne=(width,), buffer=1, data=0x1000 + (2 + i) * size,
                                   op=int(GgmlOp.ADD), flags=int(TensorFlag.COMPUTE), src=[prev, 2]))
        nodes.append(tid)
        prev = tid
    return tensors, nodes, (1 + n) * size


def bench_chain() -> None:
    n, width = 2000, 16
    tensors, nodes, last = _chain(n, width)
    table = tensors_array(tensors)
    node_ids = np.array(nodes, dtype=np.uint64)

    class Buf:
        base, size = 0x1000, (n + 2) * 4 * width
        memory = np.zeros((n + 2) * 4 * width, dtype=np.uint8)

    Buf.memory[: 8 * width].view(np.float32)[:] = 1.0

    def build_and_run() -> None:
        graph = build_graph(node_ids, table, {1: Buf})
        prepare(graph.nodes).run()
        Buf.memory[last : last + 4 * width].copy()

    graph = build_graph(node_ids, table, {1: Buf})
    plan = prepare(graph.nodes)
    t_build = cpu_best(lambda: build_graph(node_ids, table, {1: Buf}))
    t_prepare = cpu_best(lambda: prepare(graph.nodes))
    t_run = cpu_best(plan.run)
    t_exec = cpu_best(lambda: execute(graph.nodes))
    t_all = cpu_best(build_and_run)
    result = Buf.memory[last : last + 4 * width].view(np.float32)
    assert np.all(result == 1.0 + n), result
    print(f"{n} chained F32 ADDs (CPU, best of 15): build_graph {t_build * 1e3:.2f} ms; prepare "
          f"{t_prepare * 1e3:.2f} ms; run a prepared plan {t_run * 1e3:.2f} ms ({t_run / n * 1e6:.2f} us/node); "
          f"execute (prepare + run) {t_exec * 1e3:.2f} ms; build + prepare + run + read {t_all * 1e3:.2f} ms "
          "(target <= 20 ms)")
    try:
        _chain_over_tcp(tensors, nodes, width)
    except Exception as exc:  # the end-to-end figure needs the server and client packages in a working state
        print(f"  over loopback TCP: not measured ({type(exc).__name__}: {exc})")


def _chain_over_tcp(tensors: list[dict], nodes: list[int], width: int) -> None:
    with running_server("7") as srv, RpcClient.connect(*srv.address) as client:
        size = (len(nodes) + 2) * 4 * width
        handle, _ = client.alloc_buffer(0, size)
        base = client.buffer_get_base(handle)
        for t in tensors:
            t["buffer"] = handle
            t["data"] = base + t["data"] - 0x1000
        ones = np.ones(2 * width, dtype=np.float32)
        client.set_tensor(tensors[0], 0, ones[:width].tobytes())
        client.set_tensor(tensors[1], 0, ones[:width].tobytes())
        out = tensors[-1]
        table = tensors_array(tensors)  # encoded once, as a client keeps its graph
        # A second graph differing in one name byte: sent in turn with the first, every GRAPH_COMPUTE is rebuilt.
        other = table.copy()
        other["name"][0] = b"x1"
        turn = [table, other]

        def compute_and_read() -> bytes:
            client.graph_compute(0, nodes, table)
            return bytes(client.get_tensor(out, 0, 4 * width))

        def new_compute_and_read() -> bytes:
            turn.reverse()
            client.graph_compute(0, nodes, turn[0])
            return bytes(client.get_tensor(out, 0, 4 * width))

        def recompute_and_read() -> bytes:
            client.graph_recompute(0)
            return bytes(client.get_tensor(out, 0, 4 * width))

        secs_new = median_time(new_compute_and_read)
        secs = median_time(compute_and_read)
        secs_re = median_time(recompute_and_read)
        got = np.frombuffer(compute_and_read(), dtype=np.float32)
        assert np.all(got == 1.0 + len(nodes)), got
        print(f"  over loopback TCP to the reference server (client in the same process; wall, median of 7): "
              f"GRAPH_COMPUTE of a new graph + GET_TENSOR {secs_new * 1e3:.2f} ms; the same GRAPH_COMPUTE again + "
              f"GET_TENSOR {secs * 1e3:.2f} ms; GRAPH_RECOMPUTE + GET_TENSOR {secs_re * 1e3:.2f} ms "
              "(upstream: 0.42 / 0.12 ms)")


def main() -> None:
    bench_matmul()
    bench_dequant()
    bench_capture()
    bench_chain()


if __name__ == "__main__":
    main()
