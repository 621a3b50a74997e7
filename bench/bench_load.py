"""Load: the reference server with ``--concurrent`` and a hash cache, many clients at once, a fuzzer beside them.

Run: ``python bench/bench_load.py [--clients 32] [--seconds 300]``.  The server runs in its own process
(``ggml-rpc serve --concurrent --cache-dir TMP``).  Each client thread, until the time is up, allocates a buffer of
its own, writes random bytes (every fourth upload flagged for the cache, as a v7 client flags a weight), reads them
back, asks SET_TENSOR_HASH for them, computes a small MUL_MAT and an ADD on them, reads the results and compares
everything with what it sent or with numpy, then frees the buffer.  Meanwhile ``ggml-rpc fuzz --server`` hammers
the same server on connections of its own.  At the end every cache file must hash to its name.

Exit code 0 only if: 0 wrong bytes or results, the server alive throughout, no crash, hang or out-of-buffer
finding of the fuzzer (its model has no cache and does not see the other clients, so it may well disagree with a
reply: those findings are listed, not failures), 0 cache entries that fail verification.
Printed: operations per second, the server's peak resident memory, and each count.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from bench_server import rss_bytes, server_process
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.spec import GgmlOp, GgmlType, TensorFlag, cache_file_name, fnv1a64, make_tensor

F16 = int(GgmlType.F16)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ops: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)
    hits: int = 0

    def add(self, ops: int = 0, wrong: int = 0, hits: int = 0, error: str | None = None) -> None:
        with self.lock:
            self.ops += ops
            self.wrong += wrong
            self.hits += hits
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def one_round(c: RpcClient, rng: np.random.Generator, round_no: int) -> tuple[int, int, int]:
    """One client round; returns (operations, wrong results, cache hits)."""
    k, m, n = 64, int(rng.integers(4, 64)), int(rng.integers(1, 8))
    w_bytes, x_bytes, o_bytes = 2 * k * m, 4 * k * n, 4 * m * n
    offsets = np.cumsum([0, _align(w_bytes), _align(x_bytes), _align(o_bytes), _align(o_bytes)])
    # Buffers of varied sizes (up to 256 KiB more than needed), so allocations do not all look alike.
    handle, _ = c.alloc_buffer(0, int(offsets[-1]) + int(rng.integers(0, 1 << 18)))
    base = c.buffer_get_base(handle)
    w_vals = rng.standard_normal((m, k)).astype(np.float16)
    x_vals = rng.standard_normal((n, k)).astype(np.float32)
    at = [base + int(o) for o in offsets]
    w = make_tensor(id=1, type=F16, ne=(k, m), buffer=handle, data=at[0])
    x = make_tensor(id=2, ne=(k, n), buffer=handle, data=at[1])
    out = make_tensor(id=3, ne=(m, n), buffer=handle, data=at[2], op=int(GgmlOp.MUL_MAT), src=[1, 2],
                      flags=int(TensorFlag.COMPUTE))
    twice = make_tensor(id=4, ne=(m, n), buffer=handle, data=at[3], op=int(GgmlOp.ADD), src=[3, 3],
                        flags=int(TensorFlag.COMPUTE))
    ops = wrong = hits = 0
    raw = w_vals.tobytes()
    c.set_tensor(w, 0, raw, cache_flag=1 if round_no % 4 == 0 else 0)
    c.set_tensor(x, 0, x_vals.tobytes())
    ops += 2
    wrong += bytes(c.get_tensor(w, 0, len(raw))) != raw
    ops += 1
    if c.set_tensor_hash(w, 0, fnv1a64(raw)):  # a hit must leave exactly these bytes
        hits += 1
        wrong += bytes(c.get_tensor(w, 0, len(raw))) != raw
        ops += 1
    ops += 1
    c.graph_compute(0, [3, 4], [w, x, out, twice])
    got = np.frombuffer(bytes(c.get_tensor(out, 0, o_bytes)), np.float32).reshape(n, m)
    want = x_vals.astype(np.float16).astype(np.float64) @ w_vals.astype(np.float64).T  # F16 vec-dot type
    wrong += not np.allclose(got, want, rtol=1e-3, atol=1e-3)
    dbl = np.frombuffer(bytes(c.get_tensor(twice, 0, o_bytes)), np.float32).reshape(n, m)
    wrong += not np.array_equal(dbl, got + got)
    ops += 3
    c.free_buffer(handle)
    ops += 1
    return ops, wrong, hits


def client(port: int, seed: int, deadline: float, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    round_no = 0
    while time.monotonic() < deadline:
        try:
            with RpcClient.connect("127.0.0.1", port, timeout=30) as c:
                for _ in range(16):  # a few rounds per connection, then a new connection
                    if time.monotonic() >= deadline:
                        break
                    ops, wrong, hits = one_round(c, rng, round_no)
                    round_no += 1
                    tally.add(ops, wrong, hits)
        except Exception as exc:  # a client that cannot talk to the server is a failure of the run, not a crash
            tally.add(error=f"client {seed}: {type(exc).__name__}: {exc}")
            return


def verify_cache(directory: Path) -> tuple[int, int]:
    """(entries, entries whose content does not hash to their name)."""
    entries = bad = 0
    for path in directory.iterdir():
        if path.name.startswith("."):
            continue
        entries += 1
        if cache_file_name(fnv1a64(path.read_bytes())) != path.name:
            bad += 1
    return entries, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300.0)
    args = ap.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.seconds <= 3600:
        ap.error("--clients 1..256, --seconds 1..3600")
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-load-") as tmp:
        cache_dir = Path(tmp) / "cache"
        with server_process("--concurrent", "--cache-dir", str(cache_dir)) as (port, pid):
            start = time.monotonic()
            deadline = start + args.seconds
            fuzz = subprocess.Popen([sys.executable, "-c", "import sys; from ggml_rpc.conformance.cli import main; "
                                     "sys.exit(main())", "fuzz", "--server", f"127.0.0.1:{port}", "--seconds",
                                     str(int(args.seconds)), "--out", os.path.join(tmp, "findings")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tally = Tally()
            threads = [threading.Thread(target=client, args=(port, seed, deadline, tally), daemon=True)
                       for seed in range(args.clients)]
            for t in threads:
                t.start()
            peak_rss, alive = 0, True
            while any(t.is_alive() for t in threads):
                peak_rss = max(peak_rss, rss_bytes(pid))
                alive = alive and os.path.exists(f"/proc/{pid}")
                time.sleep(0.5)
            for t in threads:
                t.join(timeout=60)
            fuzz_out, _ = fuzz.communicate(timeout=args.seconds + 120)
            elapsed = time.monotonic() - start
            alive = alive and os.path.exists(f"/proc/{pid}")
        entries, bad = verify_cache(cache_dir)
    # The fuzzer's model of the server has no cache, and other clients change what the server holds: a reply that
    # differs from the model's is expected here; what must not happen is a crash, a hang or an out-of-buffer read.
    counts = re.search(r"findings: (\d+) crash, (\d+) hang, (\d+) wrong-reply, (\d+) out-of-buffer", fuzz_out)
    findings = counts is None if fuzz.returncode else False
    if counts is not None:
        findings = int(counts[1]) + int(counts[2]) + int(counts[4]) > 0
    print(f"{args.clients} clients for {elapsed:.0f} s with a fuzzer beside them")
    print(f"  operations: {tally.ops:,} ({tally.ops / elapsed:,.0f}/s); cache hits {tally.hits:,}")
    print(f"  wrong bytes or results: {tally.wrong}; client errors: {len(tally.errors)}")
    print(f"  server alive throughout: {alive}; peak RSS {peak_rss / 2**20:,.0f} MiB")
    print(f"  cache entries {entries}, failing verification {bad}")
    print(f"  fuzzer: exit {fuzz.returncode}")
    for line in fuzz_out.strip().splitlines()[-8:]:
        print(f"    {line}")
    for e in tally.errors:
        print(f"  {e}")
    return 0 if (tally.wrong == 0 and not tally.errors and alive and not findings and bad == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
