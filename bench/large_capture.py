"""A synthetic capture of about 1 GB and a way to measure a command's peak memory on it.

The capture is one v7 session: HELLO, a buffer large enough for every tensor, ``tensors`` SET_TENSORs of ``size``
bytes each, then each tensor read back whole (its GET_TENSOR reply the same bytes: a replay against any correct
server compares them exactly).  It is written with :class:`~..sessions.pcapwrite.PcapWriter` one message at a time,
so writing it holds one payload.  The bounded-memory test and ``bench/bench_bounded.py`` use it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter
from ggml_rpc.spec import V7, Command, GgmlType, encode_reply, encode_request, fnv1a64, make_tensor
from ggml_rpc.spec.facts import hello_reply

MiB = 1 << 20

#: Runs argv as a child and prints its wall time and peak RSS (RUSAGE_CHILDREN: this wrapper's only child).
#: The first argument is the time limit in seconds ("" for none): a child still running then is killed, its ``rc``
#: is null and ``timed_out`` true (its peak RSS up to then still counts).
_WRAPPER = """
import json, resource, subprocess, sys, time
limit = float(sys.argv[1]) if sys.argv[1] else None
start = time.perf_counter()
try:
    done = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=limit)
    rc, err, timed_out = done.returncode, done.stderr, False
except subprocess.TimeoutExpired as exc:
    rc, err, timed_out = None, exc.stderr or b"", True
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": peak, "rc": rc, "timed_out": timed_out,
                  "stderr": err.decode(errors="replace")[-2000:]}))
"""


def payload(size: int, seed: int) -> bytes:
    """``size`` bytes of F32 values (finite, varied): cheap to make, not compressible by accident."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(size // 4, dtype=np.float32).tobytes()


def write_large_capture(path: str | Path, *, tensors: int = 3, size: int = 256 * MiB, hash_first: bool = False) -> int:
    """Write the session to ``path``; returns the bytes of RPC payload it carries.  ``hash_first``: each SET_TENSOR
    comes after a SET_TENSOR_HASH that missed and carries the cache flag, as a v7 client sends a weight, so that a
    checker must hash the whole payload to judge it."""
    base, handle = 0x10000, 0x5A5A0000
    total = 0
    with PcapWriter(path, start=1_700_000_000.0) as w:
        flow = w.flow()

        def exchange(command: Command, fields: dict, data: bytes | None = None, reply: bytes | None = None) -> None:
            nonlocal total
            req = encode_request(V7, command, fields, data)
            flow.write(True, req)
            total += len(req)
            if reply is not None:
                flow.write(False, reply)
                total += len(reply)

        exchange(Command.HELLO, {"conn_caps": bytes(24)}, reply=encode_reply(V7, Command.HELLO, hello_reply((7, 0, 0))))
        exchange(Command.ALLOC_BUFFER, {"device": 0, "size": tensors * size},
                 reply=encode_reply(V7, Command.ALLOC_BUFFER, {"remote_ptr": handle, "remote_size": tensors * size}))
        exchange(Command.BUFFER_GET_BASE, {"remote_ptr": handle},
                 reply=encode_reply(V7, Command.BUFFER_GET_BASE, {"base_ptr": base}))
        made = [make_tensor(id=i + 1, type=GgmlType.F32, ne=(size // 4,), buffer=handle, data=base + i * size)
                for i in range(tensors)]
        for i, t in enumerate(made):
            data = payload(size, i)
            if hash_first:
                exchange(Command.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": fnv1a64(data)},
                         reply=encode_reply(V7, Command.SET_TENSOR_HASH, {"result": 0}))
            exchange(Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": int(hash_first)}, data)
        for i, t in enumerate(made):
            data = payload(size, i)
            exchange(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": size},
                     reply=encode_reply(V7, Command.GET_TENSOR, {}, data))
        exchange(Command.FREE_BUFFER, {"remote_ptr": handle})
        flow.close()
    return total


def measure(argv: list[str], timeout: float | None = None) -> dict:
    """Wall time, peak RSS (KiB) and exit code of ``argv`` run as a child of a fresh wrapper process; with
    ``timeout`` (seconds) a child still running then is killed and reported with ``timed_out`` true."""
    limit = "" if timeout is None else repr(float(timeout))
    # The wrapper itself gets a margin to kill its child and report; past that it is stopped too (an error).
    outer = None if timeout is None else timeout + 60.0
    out = subprocess.run([sys.executable, "-c", _WRAPPER, limit, *argv], capture_output=True, text=True, check=True,
                         timeout=outer)
    return json.loads(out.stdout)
