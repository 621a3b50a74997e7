"""The kit's own figures in ``ggml-rpc bench``: writing a session as a pcap, decoding it, replaying it.

All three work on one session made for the purpose: a connection that allocates a buffer, then alternates
SET_TENSOR and GET_TENSOR of ``chunk``-byte tensors until ``data_bytes`` of tensor data went over the wire, each
GET reading back what the SET before it wrote (so a replay compares every read exactly, and the session is a
valid one for any server).  Requests and replies are encoded by the spec's codec; the pcap is written by
:mod:`~ggml_rpc.conformance.sessions.pcapwrite` from the codec's buffers (the bulk data is a small pool of random
chunks, never copied); decoding is :func:`~ggml_rpc.conformance.sessions.decode.decode_file`; replaying is
:class:`~ggml_rpc.conformance.sessions.replay.Replayer` against each server target, translated to the target's
version.

Throughputs are in MB/s (10^6 bytes): pcap writing per byte of TCP payload, decoding per byte of pcap file (the
unit of the decode target), replay per byte sent and received.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.replay import LoadedCapture, Replayer, load_captures
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    Command,
    GgmlType,
    Protocol,
    RequestDecoder,
    encode_request,
    hello_reply,
    make_tensor,
    reply_parts,
    request_parts,
)

from .runner import Figure, Measurement, timed
from .server_figures import BenchTarget, chain_graph, size_label

#: Handle and base the session's (made-up) server hands out; replay relocates them to the target's.
_HANDLE, _BASE = 0x5EED0001, 0x7F0000000000
_POOL = 4  # distinct data chunks the session cycles through


@dataclass
class SyntheticSession:
    """The writes of each connection, as ``write_session`` takes them, and the tensor data they carry."""

    protocol: Protocol
    connections: list[list[tuple[bool, Any]]]
    data_bytes: int
    payload_bytes: int


def make_session(protocol: Protocol, data_bytes: int, chunk: int = 1 << 20, slots: int = 16) -> SyntheticSession:
    """One connection moving ``data_bytes`` of tensor data (half SET, half GET) in ``chunk``-byte messages."""
    if chunk <= 0 or data_bytes < 2 * chunk:
        raise ValueError("data_bytes must hold at least one SET and one GET of a chunk")
    rng = np.random.default_rng(2)
    pool = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(_POOL)]
    writes: list[tuple[bool, Any]] = []

    def exchange(command: Command, fields: dict[str, Any] | None = None, reply: dict[str, Any] | None = None,
                 data: Any = None, reply_data: Any = None) -> None:
        writes.extend((True, p) for p in request_parts(protocol, command, fields, data))
        spec = protocol.spec(command)
        if spec is not None and spec.has_reply:
            writes.extend((False, p) for p in reply_parts(protocol, command, reply, reply_data))

    exchange(Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)}, hello_reply(protocol.version))
    size = chunk * slots
    exchange(Command.ALLOC_BUFFER, {"device": 0, "size": size}, {"remote_ptr": _HANDLE, "remote_size": size})
    exchange(Command.BUFFER_GET_BASE, {"remote_ptr": _HANDLE}, {"base_ptr": _BASE})
    moved = 0
    i = 0
    flag = {protocol.cache_rule.flag_field: 0} if protocol.cache_rule.flag_field else {}
    while moved + 2 * chunk <= data_bytes:
        slot = i % slots
        t = make_tensor(id=0x100 + slot, type=int(GgmlType.I8), ne=(chunk,), buffer=_HANDLE,
                        data=_BASE + slot * chunk, name=f"t{slot}")
        data = pool[i % _POOL]
        exchange(Command.SET_TENSOR, {"tensor": t, "offset": 0, **flag}, data=data)
        exchange(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": chunk}, {}, reply_data=data)
        moved += 2 * chunk
        i += 1
    exchange(Command.FREE_BUFFER, {"remote_ptr": _HANDLE})
    payload = sum(memoryview(p).nbytes for _, p in writes)
    return SyntheticSession(protocol, [writes], moved, payload)


class SessionFiles:
    """The benchmark session and its pcap in a temporary directory (removed by :meth:`close`)."""

    def __init__(self, protocol: Protocol, data_bytes: int, chunk: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="ggml-rpc-bench-")
        self.session = make_session(protocol, data_bytes, chunk)
        self.pcap = Path(self._dir.name) / "session.pcap"
        self.scratch = Path(self._dir.name) / "write.pcap"
        write_session(self.pcap, self.session.connections)
        self._loaded: list[LoadedCapture] | None = None

    @property
    def loaded(self) -> list[LoadedCapture]:
        """The decoded session, for replay (decoded once)."""
        if self._loaded is None:
            self._loaded = load_captures([self.pcap])
        return self._loaded

    def close(self) -> None:
        self._loaded = None
        self._dir.cleanup()


class PcapWrite(Measurement[SessionFiles]):
    """Writing the session as a pcap with TCP framing: MB/s of TCP payload."""

    def __init__(self, files: SessionFiles, goal: tuple[str, float, str] | None = None) -> None:
        self.files = files
        self.figure = Figure("pcap_write", f"pcap writing ({size_label(files.session.data_bytes)} session)", "MB/s",
                             goal=goal)

    def prepare(self, target: object) -> SessionFiles:
        return self.files

    def sample(self, state: SessionFiles) -> float:
        seconds = timed(lambda: write_session(state.scratch, state.session.connections))
        return state.session.payload_bytes / seconds / 1e6


class PcapDecode(Measurement[Path]):
    """Reading, reassembling and decoding every message of a pcap: MB/s of pcap file."""

    def __init__(self, path: Path, label: str, goal: tuple[str, float, str] | None = None) -> None:
        self.path = path
        self.figure = Figure("pcap_decode", f"pcap decode ({label})", "MB/s", goal=goal)

    def prepare(self, target: object) -> Path:
        return self.path

    def sample(self, state: Path) -> float:
        size = state.stat().st_size
        result: list = []
        seconds = timed(lambda: result.extend(decode_file(state)))
        bad = [dc for dc in result if dc.error is not None]
        if bad:
            raise RuntimeError(f"connection {bad[0].conn.index} does not decode: {bad[0].error}")
        return size / seconds / 1e6


class GraphDecode(Measurement[bytes]):
    """Decoding (with the spec's checks) one GRAPH_COMPUTE request of ``n_tensors`` tensors, in milliseconds."""

    def __init__(self, protocol: Protocol, n_tensors: int, goal: tuple[str, float, str] | None = None) -> None:
        self.protocol, self.n = protocol, n_tensors
        self.figure = Figure(f"graph_decode_{n_tensors}", f"GRAPH_COMPUTE {n_tensors:,} tensors decode", "ms",
                             higher_is_better=False, goal=goal)

    def prepare(self, target: object) -> bytes:
        nodes, tensors = chain_graph(self.n, _HANDLE, _BASE)
        return encode_request(self.protocol, Command.GRAPH_COMPUTE, {
            "device": 0, "n_nodes": len(nodes), "nodes": nodes, "n_tensors": len(tensors), "tensors": tensors})

    def sample(self, state: bytes) -> float:
        out: list = []
        seconds = timed(lambda: out.extend(RequestDecoder(self.protocol, expect_hello=False).feed(state)))
        if len(out) != 1 or out[0].fields["n_tensors"] != self.n:
            raise RuntimeError("the GRAPH_COMPUTE request did not decode to itself")
        return seconds * 1e3


class Replay(Measurement["_ReplayState"]):
    """Replaying the session against a server (translated to its version), every read compared: MB/s.

    A capture that uses the hash cache replays first against the cache state it recorded (an empty cache, as the
    reference server's temporary one), then against what the earlier replays left in it.
    """

    def __init__(self, captures: Any, label: str, goal: tuple[str, float, str] | None = None) -> None:
        #: A SessionFiles (its decoded session) or a list of LoadedCapture.
        self.captures = captures
        self.figure = Figure("replay", f"replay ({label})", "MB/s", goal=goal)

    def prepare(self, target: BenchTarget) -> _ReplayState:
        if target.version is None:
            target.connect().close()
        loaded = self.captures.loaded if isinstance(self.captures, SessionFiles) else self.captures
        return _ReplayState(target, loaded)

    def sample(self, state: _ReplayState) -> float:
        t = state.target
        replayer = Replayer(state.loaded, t.host, t.port, as_protocol=t.protocol)
        if state.cache is not None:
            # The target's hash cache outlives a replay: what the last one saved, the next one hits.
            replayer.cache = state.cache
        report = replayer.run()
        state.cache = replayer.cache
        if not report.ok:
            first = report.mismatches[0]
            raise RuntimeError(f"{len(report.mismatches)} mismatch(es), first: {first.line()}")
        return (report.bytes_sent + report.bytes_received) / report.seconds / 1e6


@dataclass
class _ReplayState:
    target: BenchTarget
    loaded: list[LoadedCapture]
    #: The replayer's model of the target's cache, carried from one replay to the next.
    cache: Any = None


__all__ = ["GraphDecode", "PcapDecode", "PcapWrite", "Replay", "SyntheticSession", "SessionFiles", "make_session"]
