"""Decoding speed: a real capture end to end from the pcap, and one GRAPH_COMPUTE of 10,000 tensors.

Run from the repository root (the real captures live beside the checkout, in ../shared/real-captures):

    python bench/bench_decode.py [--capture PATH] [--repeat N]

Targets: >= 500 MB/s for the capture (file bytes per second: read, reassemble, decode every message) and
<= 10 ms for the graph.  The dpkt-only reading path is measured too, as the ratio the struct fast path buys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from ggml_rpc.bench.runner import samples
from ggml_rpc.conformance.sessions import capture
from ggml_rpc.conformance.sessions.decode import decode_connection
from ggml_rpc.spec import TENSOR_DTYPE, V7, Command, RequestDecoder, encode_request

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CAPTURE = ROOT.parent / "shared" / "real-captures" / "v7-v7-gen-cold.pcap"
CAPTURE_TARGET_MBPS = 500.0
GRAPH_TARGET_MS = 10.0


def decode_capture(path: Path) -> int:
    """Read, reassemble and decode every connection; returns the number of messages."""
    n = 0
    for conn in capture.read_connections(path):
        dc = decode_connection(conn)
        if dc.error is not None:
            raise SystemExit(f"{path.name}: connection {conn.index}: {dc.error}")
        n += len(dc.requests) + len(dc.replies)
    return n


def bench_capture(path: Path, repeat: int) -> tuple[float, float]:
    size = path.stat().st_size
    messages = decode_capture(path)
    times = samples(lambda: decode_capture(path), repeat)
    best, median = min(times), statistics.median(times)
    print(f"capture {path.name}: {size / 1e6:.1f} MB, {messages} messages")
    print(f"  end to end (fast path): best {best * 1e3:.1f} ms = {size / best / 1e6:.0f} MB/s, "
          f"median {median * 1e3:.1f} ms = {size / median / 1e6:.0f} MB/s  (target >= {CAPTURE_TARGET_MBPS:.0f})")

    fast = capture.kind
    capture.kind = lambda data: None  # force dpkt's readers (payloads in memory) for comparison
    try:
        slow = samples(lambda: decode_capture(path), max(3, repeat // 3))
    finally:
        capture.kind = fast
    print(f"  end to end (dpkt path): median {statistics.median(slow) * 1e3:.1f} ms = "
          f"{size / statistics.median(slow) / 1e6:.0f} MB/s; fast path is {statistics.median(slow) / median:.1f}x")

    conns = capture.read_connections(path)
    decode_only = samples(lambda: [decode_connection(c) for c in conns], repeat)
    read_only = samples(lambda: capture.read_connections(path), repeat)
    print(f"  split (medians): read+reassemble {statistics.median(read_only) * 1e3:.1f} ms, "
          f"decode {statistics.median(decode_only) * 1e3:.1f} ms")
    return size / best / 1e6, size / median / 1e6


def graph_request(n_tensors: int) -> bytes:
    """A GRAPH_COMPUTE whose tensors form a chain: each node uses the previous one."""
    tensors = np.zeros(n_tensors, dtype=TENSOR_DTYPE)
    ids = np.arange(1, n_tensors + 1, dtype=np.uint64) * 0x100
    tensors["id"] = ids
    tensors["type"] = 0
    tensors["ne"] = [64, 64, 1, 1]
    tensors["nb"] = [4, 256, 16384, 16384]
    tensors["op"] = 2  # ADD
    tensors["flags"] = 16
    tensors["src"][1:, 0] = ids[:-1]
    tensors["use_count"] = 1
    fields = {"device": 0, "n_nodes": n_tensors, "nodes": ids, "n_tensors": n_tensors, "tensors": tensors}
    return encode_request(V7, Command.GRAPH_COMPUTE, fields)


def bench_graph(n_tensors: int, repeat: int) -> float:
    wire = graph_request(n_tensors)

    def decode(validate: bool) -> None:
        (req,) = RequestDecoder(V7, expect_hello=False, validate=validate).feed(wire)
        assert req.fields["n_tensors"] == n_tensors

    checked = samples(lambda: decode(True), repeat)
    framed = samples(lambda: decode(False), repeat)
    print(f"GRAPH_COMPUTE of {n_tensors} tensors ({len(wire) / 1e6:.2f} MB):")
    print(f"  decode + checks: best {min(checked) * 1e3:.3f} ms, median {statistics.median(checked) * 1e3:.3f} ms "
          f"(target <= {GRAPH_TARGET_MS:.0f} ms); decode only: median {statistics.median(framed) * 1e3:.3f} ms")
    return statistics.median(checked) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capture", type=Path, default=DEFAULT_CAPTURE)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--tensors", type=int, default=10_000)
    args = parser.parse_args(argv)
    if not args.capture.exists():
        print(f"capture not found: {args.capture}", file=sys.stderr)
        return 2
    best, median = bench_capture(args.capture, args.repeat)
    graph_ms = bench_graph(args.tensors, args.repeat * 4)
    print(f"summary: capture {median:.0f} MB/s median ({best:.0f} best) vs {CAPTURE_TARGET_MBPS:.0f}: "
          f"{'ok' if median >= CAPTURE_TARGET_MBPS else 'BELOW TARGET'}; graph {graph_ms:.2f} ms vs "
          f"{GRAPH_TARGET_MS:.0f}: {'ok' if graph_ms <= GRAPH_TARGET_MS else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
