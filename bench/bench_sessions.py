"""Session tooling benchmarks: pcap writing, replay throughput, recording-proxy overhead.

Run: ``python bench/bench_sessions.py [--quick] [--replay-mib 1024] [--proxy-mib 256]``.

* pcap writing: MB/s of payload written as TCP segments (default MSS and Ethernet MSS 1460).  Bar: >= 200 MB/s.
* replay: a session carrying ``--replay-mib`` of tensor data (SET_TENSORs of 64 MiB, a read back of the last one)
  replayed against the reference server running as its own process (``ggml-rpc serve``).  The session is decoded
  with the spec's stream decoders from chunks that share one 64 MiB data buffer, so the figure is the replayer's
  and not the machine's free memory.  Bar: >= 300 MB/s.
* proxy overhead: wall time of a ``--proxy-mib`` SET_TENSOR plus its read back, direct to the server versus
  through ``ggml-rpc proxy`` (own process; with ``--check``, and with ``--check --pcap``).  Bar: <= 10 % added.

Figures are medians over several runs.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.capture import Connection
from ggml_rpc.conformance.sessions.decode import DecodedConnection
from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.conformance.sessions.replay import LoadedCapture, Replayer, load_captures
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    TENSOR_DTYPE,
    V7,
    Command,
    GgmlType,
    Reply,
    ReplyDecoder,
    Request,
    RequestDecoder,
    encode_reply,
    hello_reply,
    make_tensor,
    reply_parts,
    request_parts,
)

MIB = 1 << 20
CHUNK = 64 * MIB


def median_of(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


@contextlib.contextmanager
def process(cmd: list[str], pattern: str, stream: str = "stderr") -> Iterator[int]:
    """A kit command in its own process; yields the port parsed from its first line matching ``pattern``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pipe = proc.stderr if stream == "stderr" else proc.stdout
        assert pipe is not None
        line = pipe.readline()
        m = re.search(pattern, line)
        if not m:
            raise RuntimeError(f"{cmd[3]} did not start: {line!r}")
        for p in (proc.stdout, proc.stderr):
            threading.Thread(target=lambda p=p: [None for _ in p], daemon=True).start()
        yield int(m.group(1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def server(mem: str = "4G") -> contextlib.AbstractContextManager[int]:
    cmd = [sys.executable, "-m", "ggml_rpc.conformance.cli", "serve", "--port", "0", "--proto", "7", "--mem", mem]
    return process(cmd, r"listening on [^ ]+:(\d+)")


def proxy(upstream: int, *extra: str) -> contextlib.AbstractContextManager[int]:
    cmd = [sys.executable, "-m", "ggml_rpc.conformance.cli", "proxy", "--listen", "127.0.0.1:0", "--upstream",
           f"127.0.0.1:{upstream}", *extra]
    return process(cmd, r"ggml-rpc proxy: [^ ]+:(\d+) ->", stream="stdout")


# ---- pcap writing ---------------------------------------------------------------------------------------------------


def bench_pcap_write(mib: int, mss: int, repeat: int) -> float:
    data = memoryview(np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
    reply = encode_reply(V7, Command.ALLOC_BUFFER, {"remote_ptr": 1, "remote_size": 1})

    def once() -> float:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            with PcapWriter(Path(d) / "w.pcap") as w:
                flow = w.flow(mss=mss)
                done = 0
                while done < mib * MIB:
                    n = min(CHUNK, mib * MIB - done)
                    flow.write(True, data[:n])
                    flow.write(False, reply)
                    done += n
                flow.close()
            return time.perf_counter() - t0

    return mib * MIB / median_of(once, repeat) / 1e6


# ---- replay -------------------------------------------------------------------------------------------------------


def replay_session(total: int) -> DecodedConnection:
    """HELLO, ALLOC, BASE, SET_TENSORs of 64 MiB adding up to ``total``, one read back; decoded from chunks."""
    data = memoryview(np.random.default_rng(2).integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
    handle, base = 0x5555_0000, 0x7F00_0000_0000
    t = make_tensor(id=1, type=int(GgmlType.I8), ne=(CHUNK,), buffer=handle, data=base, name="bulk")
    reqs = RequestDecoder()
    reps = ReplyDecoder()
    out = DecodedConnection(Connection(0, ("127.0.0.1", 40000), ("127.0.0.1", 50052), 0.0, saw_syn=True), V7)

    def request(cmd: Command, fields: dict, payload: memoryview | None = None, reply: dict | None = None,
                reply_data: memoryview | None = None) -> None:
        for part in request_parts(V7, cmd, fields, payload):
            reqs.receive_data(part)
        req = reqs.next_message()
        assert req is not None
        out.requests.append(req)
        if reps.expect(req):
            for part in reply_parts(V7, cmd, reply, reply_data):
                reps.receive_data(part)
            rep = reps.next_message()
            assert rep is not None
            out.replies.append(rep)

    request(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)}, reply=hello_reply(V7.version))
    reps.protocol = reqs.protocol = V7
    request(Command.ALLOC_BUFFER, {"device": 0, "size": CHUNK}, reply={"remote_ptr": handle, "remote_size": CHUNK})
    request(Command.BUFFER_GET_BASE, {"remote_ptr": handle}, reply={"base_ptr": base})
    for _ in range(total // CHUNK):
        request(Command.SET_TENSOR, {"tensor": t, "cache_flag": 0, "offset": 0}, data)
    request(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": CHUNK}, reply_data=data)
    request(Command.FREE_BUFFER, {"remote_ptr": handle})
    return out


def bench_replay(mib: int, repeat: int) -> tuple[float, float]:
    """(replay MB/s, the kit client's own MB/s for the same transfers) against a reference server process."""
    session = replay_session(mib * MIB)
    data = session.requests[3].data
    assert data is not None
    with server() as port:
        def once() -> float:
            t0 = time.perf_counter()
            report = Replayer([LoadedCapture("synthetic", [session])], "127.0.0.1", port).run()
            dt = time.perf_counter() - t0
            if report.mismatches:
                raise RuntimeError(report.mismatches[0].line())
            return dt

        def direct() -> float:
            t0 = time.perf_counter()
            with RpcClient.connect("127.0.0.1", port) as c:
                h, _ = c.alloc_buffer(0, CHUNK)
                t = make_tensor(id=1, type=int(GgmlType.I8), ne=(CHUNK,), buffer=h, data=c.buffer_get_base(h))
                for _ in range(mib * MIB // CHUNK):
                    c.set_tensor(t, 0, data)
                c.get_tensor(t, 0, CHUNK)
                c.free_buffer(h)
            return time.perf_counter() - t0

        moved = (mib * MIB + CHUNK) / 1e6
        return moved / median_of(once, repeat), moved / median_of(direct, repeat)


def bench_replay_pcap(mib: int) -> tuple[float, float, float]:
    """The same session written to a pcap, then read, decoded and replayed: (pcap MB, load s, replay s)."""
    session = replay_session(mib * MIB)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "session.pcap"
        with PcapWriter(path) as w:
            flow = w.flow()
            for msg in session.messages():
                flow.write(msg in session.requests, request_or_reply_parts(msg))
            flow.close()
        size = path.stat().st_size / 1e6
        t0 = time.perf_counter()
        captures = load_captures([path])
        load = time.perf_counter() - t0
        with server() as port:
            report = Replayer(captures, "127.0.0.1", port).run()
        if report.mismatches:
            raise RuntimeError(report.mismatches[0].line())
        return size, load, report.seconds


def request_or_reply_parts(msg: Request | Reply) -> bytes:
    """The wire bytes of one decoded message (re-encoded from its fields; bulk data joined once)."""
    if isinstance(msg, Reply):
        return b"".join(bytes(p) for p in reply_parts(V7, msg.command, msg.fields, msg.data))
    return b"".join(bytes(p) for p in request_parts(V7, msg.command, msg.fields, msg.data))


def bench_relocation(n_tensors: int, repeat: int) -> float:
    """Seconds to relocate every tensor of one GRAPH_COMPUTE of ``n_tensors`` tensors over 8 buffers."""
    reloc = Relocator()
    for i in range(8):
        reloc.buffer(0x1000 + i, 0x9000 + i)
        reloc.base(0x1000 + i, 0x7000_0000 + (i << 24), 0x5_0000_0000 + (i << 24))
    rng = np.random.default_rng(4)
    tensors = np.zeros(n_tensors, dtype=TENSOR_DTYPE)
    tensors["buffer"] = 0x1000 + rng.integers(0, 8, n_tensors)
    tensors["data"] = 0x7000_0000 + (((tensors["buffer"] - 0x1000) << 24) + rng.integers(0, 1 << 20, n_tensors))

    def once() -> float:
        t0 = time.perf_counter()
        reloc.tensor_array(tensors)
        return time.perf_counter() - t0

    return median_of(once, repeat)


# ---- proxy overhead ------------------------------------------------------------------------------------------------


def transfer(port: int, data: memoryview) -> float:
    t0 = time.perf_counter()
    with RpcClient.connect("127.0.0.1", port) as c:
        h, _ = c.alloc_buffer(0, data.nbytes)
        t = make_tensor(id=1, type=int(GgmlType.I8), ne=(data.nbytes,), buffer=h, data=c.buffer_get_base(h))
        c.set_tensor(t, 0, data)
        out = bytearray(data.nbytes)
        c.get_tensor_into(t, 0, memoryview(out))
        c.free_buffer(h)
    return time.perf_counter() - t0


#: The least any user-space proxy process can do: splice both directions, no decoding (the floor for comparison).
BARE_FORWARDER = """
import fcntl, os, socket, sys, threading
up = int(sys.argv[1])
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4)
print(f"ggml-rpc proxy: 127.0.0.1:{ls.getsockname()[1]} -> bare", flush=True)
def pump(a, b):
    r, w = os.pipe(); fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    while (n := os.splice(a.fileno(), w, 1 << 20)):
        o = 0
        while o < n:
            o += os.splice(r, b.fileno(), n - o)
    b.shutdown(socket.SHUT_WR)
while True:
    c, _ = ls.accept(); u = socket.create_connection(("127.0.0.1", up))
    for s in (c, u):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=pump, args=(c, u), daemon=True).start()
    threading.Thread(target=pump, args=(u, c), daemon=True).start()
"""


def bench_proxy(mib: int, repeat: int) -> dict[str, float]:
    """Medians of interleaved samples (the machine's load drifts; interleaving keeps the comparison fair)."""
    data = memoryview(np.random.default_rng(3).integers(0, 256, mib * MIB, dtype=np.uint8).tobytes())
    samples: dict[str, list[float]] = {"direct": [], "bare splice forwarder (floor)": [], "proxy --check": [],
                                       "proxy --check --pcap": []}
    with server() as port, tempfile.TemporaryDirectory() as d, \
            process([sys.executable, "-c", BARE_FORWARDER, str(port)], r"proxy: [^ ]+:(\d+)", "stdout") as bare, \
            proxy(port, "--check") as checked, \
            proxy(port, "--check", "--pcap", str(Path(d) / "p.pcap")) as recorded:
        transfer(port, data)  # warm up the server's allocator
        ports = dict(zip(samples, (port, bare, checked, recorded), strict=True))
        samples[DISK] = []
        for _ in range(repeat):
            for name, p in ports.items():
                samples[name].append(transfer(p, data))
            samples[DISK].append(disk_write(Path(d) / "plain", data, copies=2))
    return {name: statistics.median(v) for name, v in samples.items()}


#: What a pcap of the transfer must cost at least on this machine: its bytes (both directions) written to a file.
DISK = "the same bytes written to a file (disk floor)"


def disk_write(path: Path, data: memoryview, copies: int) -> float:
    """Seconds to write ``copies`` times ``data`` to ``path`` in 1 MiB writes, as the pcap writer does (no fsync)."""
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(copies):
            for start in range(0, data.nbytes, MIB):
                fh.write(data[start : start + MIB])
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer runs")
    ap.add_argument("--replay-mib", type=int, default=1024)
    ap.add_argument("--proxy-mib", type=int, default=256)
    ap.add_argument("--pcap-mib", type=int, default=512)
    ap.add_argument("--only", choices=["pcap", "replay", "proxy"], default=None)
    args = ap.parse_args()
    repeat = 1 if args.quick else 3
    scale = 8 if args.quick else 1
    if args.only in (None, "pcap"):
        mib = max(64, args.pcap_mib // scale)
        for mss in (65495, 1460):
            rate = bench_pcap_write(mib, mss, repeat)
            print(f"pcap writing, {mib} MiB payload, MSS {mss:>5}: {rate:8.0f} MB/s (bar >= 200 MB/s at the default)")
    if args.only in (None, "replay"):
        mib = max(128, args.replay_mib // scale)
        rate, direct = bench_replay(mib, repeat)
        print(f"replay, {mib} MiB of SET_TENSOR data + 64 MiB read back: {rate:8.0f} MB/s (bar >= 300 MB/s); "
              f"the kit client alone: {direct:.0f} MB/s")
        t = bench_relocation(10_000, 20)
        print(f"relocating a 10,000-tensor GRAPH_COMPUTE: {t * 1e6:.0f} us")
        size, load, seconds = bench_replay_pcap(mib)
        moved = (mib * MIB + CHUNK) / 1e6
        print(f"replay from a {size:.0f} MB pcap: reading and decoding {load:.2f} s ({size / load:.0f} MB/s), "
              f"replaying {seconds:.2f} s ({moved / seconds:.0f} MB/s), end to end {moved / (load + seconds):.0f} MB/s")
    if args.only in (None, "proxy"):
        mib = max(32, args.proxy_mib // scale)
        times = bench_proxy(mib, 3 if args.quick else 7)
        disk = times.pop(DISK)
        base = times["direct"]
        floor = 100 * (times["bare splice forwarder (floor)"] / base - 1)
        # The proxy's bars: --check within 10 points of the splice floor, --pcap within 30 (measured in this run).
        bars = {"proxy --check": 10, "proxy --check --pcap": 30}
        for name, t in times.items():
            extra = ""
            if name != "direct":
                extra = f"  overhead {100 * (t / base - 1):+6.1f} %"
                if name in bars:
                    above = 100 * (t / base - 1) - floor
                    extra += f" = floor {above:+6.1f} points (bar <= +{bars[name]})"
            print(f"{mib} MiB SET_TENSOR + read back, {name:30}: {t * 1000:8.1f} ms{extra}")
        print(f"{2 * mib} MiB (what the pcap holds) written to a file in 1 MiB writes: {disk * 1000:8.1f} ms "
              f"({2 * mib * MIB / disk / 1e6:.0f} MB/s): --pcap adds "
              f"{(times['proxy --check --pcap'] - times['proxy --check']) * 1000:.0f} ms to --check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
