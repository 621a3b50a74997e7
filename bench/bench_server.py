"""Reference server benchmarks: bulk transfer speed, small round trips, resident memory while streaming, graphs.

Run: ``python bench/bench_server.py [--quick]``.  The server runs as a separate process (``ggml-rpc serve``), as a
user would run it, so client and server do not share an interpreter; figures are medians over several runs and
are printed next to their bars and upstream's own figures (its C++ server, 6.0.0 and 7.0.0, on a 2-core loopback
machine).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from ggml_rpc.bench.runner import samples
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import ServerCore, make_config
from ggml_rpc.reference.executor import prepare
from ggml_rpc.reference.graph import build_graph
from ggml_rpc.reference.server import serve_connection
from ggml_rpc.spec import REPLY_HEADER_SIZE, TENSOR_DTYPE, Command, GgmlOp, encode_request, make_tensor, request_parts
from ggml_rpc.spec.codec import REQUEST_HEADER
from ggml_rpc.spec.tensor import GGML_MAX_SRC

MIB = 1 << 20

# `ggml-rpc serve` in a fresh interpreter, through the package's entry function (as the console script runs it).
SERVE_CMD = [sys.executable, "-c", "import sys; from ggml_rpc.conformance.cli import main; sys.exit(main())", "serve"]


@contextmanager
def server_process(*extra: str):
    """``ggml-rpc serve`` on an ephemeral loopback port; yields (port, pid)."""
    cmd = [*SERVE_CMD, "--port", "0", "--mem", "8G", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"listening on [^ ]+:(\d+)", line)
        if not m:
            raise RuntimeError(f"server did not start: {line!r}")
        # Keep draining its log so it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        yield int(m.group(1)), proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_bulk(port: int, pid: int, size: int, repeat: int) -> tuple[float, float, float, float]:
    """Wall-clock GB/s of SET and GET, and GB per server CPU second for each (what one idle core would give)."""
    with RpcClient.connect("127.0.0.1", port, timeout=120) as c:
        handle, _ = c.alloc_buffer(0, size)
        base = c.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(size // 4,), buffer=handle, data=base)
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        out = np.empty(size, dtype=np.uint8)

        def set_once() -> None:
            c.set_tensor(t, 0, data)
            c.get_alignment(0)  # the SET has no reply: this round trip proves it was consumed

        def get_once() -> None:
            c.get_tensor_into(t, 0, memoryview(out))

        set_once()  # first touch of the buffer's pages is not what is measured
        cpu0 = cpu_seconds(pid)
        set_times = samples(set_once, repeat)
        cpu1 = cpu_seconds(pid)
        get_times = samples(get_once, repeat)
        cpu2 = cpu_seconds(pid)
        assert np.array_equal(out, data)
        c.free_buffer(handle)
    gb = size * repeat / 1e9
    return (size / statistics.median(set_times) / 1e9, size / statistics.median(get_times) / 1e9,
            gb / max(cpu1 - cpu0, 1e-3), gb / max(cpu2 - cpu1, 1e-3))


def bench_round_trips(port: int, pid: int, n: int) -> tuple[float, float, float]:
    """Round trips/s through RpcClient and with pre-encoded bytes, and server CPU microseconds per round trip."""
    with RpcClient.connect("127.0.0.1", port, timeout=30) as c:
        for _ in range(200):
            c.get_alignment(0)
        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        for _ in range(n):
            c.get_alignment(0)
        client_rate = n / (time.perf_counter() - t0)
        server_us = (cpu_seconds(pid) - cpu0) / n * 1e6
        # The same exchange without the client's encode/decode: what the server alone sustains.
        req = encode_request(c.protocol, Command.GET_ALIGNMENT, {"device": 0})
        reply = bytearray(16)
        view = memoryview(reply)
        sock = c.sock
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(req)
            got = 0
            while got < 16:
                got += sock.recv_into(view[got:])
        raw_rate = n / (time.perf_counter() - t0)
        assert reply[8:] == (32).to_bytes(8, "little")
    return client_rate, raw_rate, server_us


def bench_small_tensors(port: int, pid: int, n: int, size: int = 4096) -> dict[str, tuple[float, float]]:
    """Small tensor traffic with pre-encoded requests (what the server alone sustains): (best rate over 3 runs,
    server CPU microseconds per message) for GET_TENSOR round trips and for pipelined SET_TENSOR messages (no reply;
    one GET_ALIGNMENT at the end proves they were all consumed)."""
    with RpcClient.connect("127.0.0.1", port, timeout=30) as c:
        handle, _ = c.alloc_buffer(0, 1 << 20)
        base = c.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(size // 4,), buffer=handle, data=base)
        payload = bytes(range(256)) * (size // 256)
        get_req = encode_request(c.protocol, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": size})
        head = b"".join(bytes(p) for p in request_parts(c.protocol, Command.SET_TENSOR,
                                                         {"tensor": t, "offset": 0, "cache_flag": 0})[1:])
        set_req = REQUEST_HEADER.pack(Command.SET_TENSOR, len(head) + size) + head + payload
        align_req = encode_request(c.protocol, Command.GET_ALIGNMENT, {"device": 0})
        reply = bytearray(8 + size)
        view = memoryview(reply)
        sock = c.sock

        def receive(want: int) -> None:
            got = 0
            while got < want:
                got += sock.recv_into(view[got:want])

        def gets() -> None:
            for _ in range(n):
                sock.sendall(get_req)
                receive(8 + size)

        def sets() -> None:
            for _ in range(n):
                sock.sendall(set_req)
            sock.sendall(align_req)
            receive(16)

        out = {}
        for name, fn in (("set", sets), ("get", gets)):
            fn()
            cpu0 = cpu_seconds(pid)
            times = samples(fn, 3)
            out[name] = (n / min(times), (cpu_seconds(pid) - cpu0) / (3 * n) * 1e6)
        assert reply[8:] == payload
    return out


def bench_command_cpu(kinds: tuple[str, ...], batches: int = 40, k: int = 500) -> dict[str, float]:
    """Server CPU microseconds per command, least of 3 runs: a connection served on a thread of this process over a
    socketpair, fed ``k`` pipelined requests at a time (its thread's CPU time: what the server's own code and system
    calls cost, whatever else the machine runs)."""
    def once(kind: str) -> float:
        ours, theirs = socket.socketpair()
        # Room for a whole batch of requests and of replies: neither side waits on the other mid-batch.
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        core = ServerCore(make_config("7"), None)
        cpu: list[float] = []

        def serve() -> None:
            t0 = time.thread_time()
            serve_connection(theirs, core)
            cpu.append(time.thread_time() - t0)

        thread = threading.Thread(target=serve)
        thread.start()
        ours.settimeout(60)
        with RpcClient(ours) as c:
            c.hello()
            handle, _ = c.alloc_buffer(0, 1 << 20)
            t = make_tensor(id=1, ne=(1024,), buffer=handle, data=c.buffer_get_base(handle))
            none = make_tensor(id=0)
            command, fields = {
                "SET_TENSOR 4 KiB": (Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}),
                "GET_ALIGNMENT": (Command.GET_ALIGNMENT, {"device": 0}),
                "GET_TENSOR 64 B": (Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 64}),
                "GET_TENSOR 4 KiB": (Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 4096}),
                "INIT_TENSOR": (Command.INIT_TENSOR, {"tensor": t}),
                "GET_ALLOC_SIZE": (Command.GET_ALLOC_SIZE,
                                   {"device": 0, "tensor": t, "srcs": [t, t] + [none] * (GGML_MAX_SRC - 2)}),
            }[kind]
            data = bytes(4096) if command is Command.SET_TENSOR else None
            req = encode_request(c.protocol, command, fields, data)
            spec = c.protocol.spec(command)
            assert spec is not None
            reply = REPLY_HEADER_SIZE + spec.reply_size(fields) if spec.has_reply else 0  # wire bytes each
            batch = req * k
            view = memoryview(bytearray(max(reply * k, 1)))
            for _ in range(batches):
                c.send_raw(batch)
                got = 0
                while got < reply * k:
                    got += ours.recv_into(view[got:])
            c.get_alignment(0)  # every request was consumed
        thread.join(timeout=60)
        return cpu[0] / (batches * k) * 1e6

    return {kind: min(once(kind) for _ in range(3)) for kind in kinds}


def bench_streaming_rss(port: int, pid: int, size: int) -> tuple[int, int, int]:
    """(server RSS before the buffer, peak RSS while streaming ``size`` bytes into it, buffer size)."""
    chunk = np.random.default_rng(1).integers(0, 256, 64 * MIB, dtype=np.uint8)
    with RpcClient.connect("127.0.0.1", port, timeout=300) as c:
        before = rss_bytes(pid)
        handle, _ = c.alloc_buffer(0, size)
        base = c.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(size // 4,), buffer=handle, data=base)
        parts = request_parts(c.protocol, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0})
        head = parts[1]
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes(pid))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        c.send_raw([REQUEST_HEADER.pack(Command.SET_TENSOR, len(head) + size), head])
        for _ in range(size // chunk.nbytes):
            c.send_raw(chunk)  # the same 64 MiB again and again: the client never holds 1 GiB
        c.get_alignment(0)
        done.set()
        sampler.join()
        peak[0] = max(peak[0], rss_bytes(pid))
        c.free_buffer(handle)
    return before, peak[0], size


def synthetic_graph(n: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """A chain of n ADD nodes over one leaf, every tensor in one buffer."""

    class Buf:
        base = 0x7F00_0000_0000
        size = (n + 1) * 64
        memory = np.zeros(size, dtype=np.uint8)

    arr = np.zeros(n + 1, dtype=TENSOR_DTYPE)
    arr["id"] = np.arange(1, n + 2) * 64
    arr["buffer"] = 0xAB
    arr["data"] = Buf.base + np.arange(n + 1) * 64
    arr["ne"] = (16, 1, 1, 1)
    arr["nb"] = (4, 64, 64, 64)
    arr["op"][1:] = GgmlOp.ADD
    arr["flags"][1:] = 16
    arr["src"][1:, 0] = arr["id"][:-1]
    arr["src"][1:, 1] = arr["id"][0]
    arr["name"] = b"blk.0.ffn_out-0"
    return arr["id"][1:].copy(), arr, {0xAB: Buf}


def bench_graph_build(n: int, repeat: int) -> tuple[float, float, float, float]:
    """Median wall-clock and least CPU seconds of rebuilding an n-node graph; least CPU seconds of preparing its
    plan and of running the plan (what a GRAPH_RECOMPUTE costs)."""
    nodes, arr, buffers = synthetic_graph(n)
    wall = statistics.median(samples(lambda: build_graph(nodes, arr, buffers), repeat))
    graph = build_graph(nodes, arr, buffers)
    plan = prepare(graph.nodes)
    cpu: dict[str, list[float]] = {"build": [], "prepare": [], "run": []}
    for _ in range(repeat):
        for what, fn in (("build", lambda: build_graph(nodes, arr, buffers)), ("prepare", lambda: prepare(graph.nodes)),
                         ("run", plan.run)):
            t0 = time.process_time()
            fn()
            cpu[what].append(time.process_time() - t0)
    return wall, min(cpu["build"]), min(cpu["prepare"]), min(cpu["run"])


def bench_graph_round_trip(port: int, pid: int, n: int, repeat: int) -> dict[str, tuple[float, float]]:
    """(median wall seconds, server CPU seconds) per exchange: a new graph each time (two graphs differing in one
    name byte, sent in turn), the same graph sent again, GRAPH_RECOMPUTE; each followed by a GET_TENSOR."""
    nodes, arr, _ = synthetic_graph(n)
    with RpcClient.connect("127.0.0.1", port, timeout=60) as c:
        handle, _ = c.alloc_buffer(0, (n + 1) * 64)
        base = c.buffer_get_base(handle)
        arr["buffer"] = handle
        arr["data"] = base + np.arange(n + 1) * 64
        last = make_tensor(id=int(nodes[-1]), ne=(16,), buffer=handle, data=base + n * 64)
        other = arr.copy()
        other["name"][0] = b"other"
        turn = [arr, other]

        def new_graph() -> None:
            turn.reverse()
            c.graph_compute(0, nodes, turn[0])
            c.get_tensor(last, 0, 64)

        def same_graph() -> None:
            c.graph_compute(0, nodes, arr)
            c.get_tensor(last, 0, 64)

        def recompute() -> None:
            c.graph_recompute(0)
            c.get_tensor(last, 0, 64)

        out = {}
        for name, fn in (("new", new_graph), ("same", same_graph), ("recompute", recompute)):
            fn()
            runs = max(repeat, 20)  # server CPU is read in clock ticks: enough exchanges to resolve milliseconds
            cpu0 = cpu_seconds(pid)
            wall = statistics.median(samples(fn, runs))
            out[name] = (wall, (cpu_seconds(pid) - cpu0) / runs)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke run)")
    args = parser.parse_args()
    bulk = 32 * MIB if args.quick else 256 * MIB
    stream = 256 * MIB if args.quick else 1 << 30
    repeat = 3 if args.quick else 5
    trips = 5_000 if args.quick else 20_000

    print(f"reference server benchmarks (python {sys.version.split()[0]}, {os.cpu_count()} cpu(s))")
    with server_process("--proto", "7") as (port, pid):
        print(f"load average before: {os.getloadavg()[0]:.2f} (figures are wall clock; the server-CPU ones do not "
              "depend on other processes)")
        set_bw, get_bw, set_cpu, get_cpu = bench_bulk(port, pid, bulk, repeat)
        print(f"SET_TENSOR {bulk // MIB} MiB: {set_bw:6.2f} GB/s; {set_cpu:6.2f} GB per server CPU second   "
              "(bar >= 1.2; upstream 1.1-1.2)")
        print(f"GET_TENSOR {bulk // MIB} MiB: {get_bw:6.2f} GB/s; {get_cpu:6.2f} GB per server CPU second   "
              "(bar >= 1.2; upstream ~1.1)")
        client_rate, raw_rate, server_us = bench_round_trips(port, pid, trips)
        print(f"GET_ALIGNMENT round trips: {client_rate:8.0f}/s through RpcClient, {raw_rate:8.0f}/s with "
              f"pre-encoded bytes; {server_us:.1f} us server CPU each   (bar >= 20,000; upstream 35-40k)")
        small = bench_small_tensors(port, pid, trips // 2)
        print(f"GET_TENSOR 4 KiB round trips: {small['get'][0]:8.0f}/s, {small['get'][1]:.1f} us server CPU each; "
              f"SET_TENSOR 4 KiB messages: {small['set'][0]:8.0f}/s, {small['set'][1]:.1f} us server CPU each   "
              "(pre-encoded; bar >= 20,000 round trips)")
        per_command = bench_command_cpu(("GET_ALIGNMENT", "GET_TENSOR 64 B", "GET_TENSOR 4 KiB", "SET_TENSOR 4 KiB",
                                          "INIT_TENSOR", "GET_ALLOC_SIZE"), batches=10 if args.quick else 40)
        print("server CPU per pipelined command (in-process thread, least of 3): "
              + ", ".join(f"{kind} {us:.1f} us" for kind, us in per_command.items()))
        before, peak, size = bench_streaming_rss(port, pid, stream)
        over = peak - before - size
        print(f"RSS streaming a {size // MIB} MiB SET_TENSOR: {before / MIB:.0f} MiB before, peak {peak / MIB:.0f} MiB "
              f"= buffer + {over / MIB:.1f} MiB   (bar: buffer + 64 MiB)")
        for n in (2000,):
            figures = bench_graph_round_trip(port, pid, n, repeat)
            (w_new, c_new), (w_same, c_same), (w_re, c_re) = figures["new"], figures["same"], figures["recompute"]
            print(f"{n}-node graph + read (wall median; server CPU): GRAPH_COMPUTE of a new graph {w_new * 1e3:.2f} ms "
                  f"({c_new * 1e3:.2f} ms CPU); the same GRAPH_COMPUTE again {w_same * 1e3:.2f} ms ({c_same * 1e3:.2f} "
                  f"ms CPU); GRAPH_RECOMPUTE {w_re * 1e3:.2f} ms ({c_re * 1e3:.2f} ms CPU)   (bar <= 20 ms; upstream "
                  "0.42 / 0.12 ms)")
    wall, build, prep, run = bench_graph_build(2000, 20)
    print(f"2000-node graph in process: build_graph {wall * 1e3:.2f} ms median, {build * 1e3:.2f} ms CPU at best; "
          f"prepare {prep * 1e3:.2f} ms CPU; run the prepared plan {run * 1e3:.2f} ms CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
