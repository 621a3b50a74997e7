"""Replaying captured sessions against any server.

The client side of every connection of the captures is sent again, in order, one connection at a time, and each
reply is compared with the recorded one by class:

* ``exact``: HELLO version (major.minor), data read back before any compute, SET_TENSOR_HASH hit/miss given the
  cache state, COPY_TENSOR result, ALLOC_BUFFER success;
* ``recorded``: server-specific values, kept but not compared (alignment, max size, memory, alloc sizes, handles,
  bases, device count, supports-op answers);
* ``computed``: GET_TENSOR after a GRAPH_COMPUTE/GRAPH_RECOMPUTE on the connection (unless it reads back exactly a
  region written since that graph ran), compared within a normalised mean squared error for float tensors (exactly
  for other types);
* ``close``: the recorded server closed instead of replying; the target must close too.

Server-assigned values are relocated: ``remote_ptr`` learnt from ALLOC_BUFFER replies, bases from BUFFER_GET_BASE,
then every tensor's ``buffer`` and ``data`` in every later request (``data = new_base + (old_data - old_base)``),
GRAPH_COMPUTE's tensors as one vectorised numpy operation.

``as_protocol`` rewrites the session for a server of another version: SET_TENSOR gains or loses its cache_flag
byte (set, as the v7 client does, only on the SET_TENSOR that follows a hash miss).

The replayer models the target's hash cache (fresh at the start, filled by the payloads the target's cache rule
saves).  When a capture needs a hit the target cannot have, it says so and sends the data instead, taken from any
SET_TENSOR of the loaded captures with that hash, or reports that no capture holds it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ggml_rpc.spec import (
    REPLY_HEADER_SIZE,
    Command,
    GgmlType,
    Protocol,
    ProtocolError,
    Reply,
    Request,
    fnv1a64,
    request_parts,
    tensor_name,
)
from ggml_rpc.spec.layout import flat_layout

from ..client import ConnectionClosed, RpcClient
from .decode import DecodedConnection, decode_file
from .lint import follows_miss

#: Default tolerance for computed reads (normalised mean squared error, as ggml's backend tests use).
DEFAULT_NMSE = 1e-6

RECORDED_ONLY = frozenset({
    Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.GET_DEVICE_MEMORY, Command.GET_ALLOC_SIZE,
    Command.BUFFER_GET_BASE, Command.DEVICE_COUNT, Command.GET_DEVICE_SUPPORTS_OP,
})
#: Types whose computed reads are compared within a tolerance (numpy dtype of their elements).
_FLOAT_TYPES = {int(GgmlType.F32): np.dtype("<f4"), int(GgmlType.F16): np.dtype("<f2"),
                int(GgmlType.F64): np.dtype("<f8")}


class ReplayError(Exception):
    """The captures cannot be replayed at all (undecodable, mixed versions without ``--as``...)."""


@dataclass
class Mismatch:
    """A reply that differs from the recorded one."""

    file: str
    connection: int
    index: int
    command: str
    kind: str  # exact / computed / close / transport
    expected: str
    got: str

    def line(self) -> str:
        return (f"{self.file} connection {self.connection} message {self.index} {self.command} [{self.kind}]: "
                f"expected {self.expected}, got {self.got}")


@dataclass
class ReplayReport:
    """What a replay did and found."""

    target: str
    source_versions: list[str] = field(default_factory=list)
    target_version: str = ""
    connections: int = 0
    requests: int = 0
    compared: dict[str, int] = field(default_factory=lambda: {"exact": 0, "computed": 0, "recorded": 0,
                                                              "close": 0})
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    worst_nmse: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


# ---- loading -----------------------------------------------------------------------------------------------------


@dataclass
class LoadedCapture:
    path: str
    connections: list[DecodedConnection]


def load_captures(paths: Sequence[str | Path], protocol: Protocol | None = None) -> list[LoadedCapture]:
    """Decode every capture; any connection that does not decode cleanly makes the replay impossible."""
    out = []
    for path in paths:
        conns = decode_file(path, protocol, validate=False)
        for dc in conns:
            # A client stream that breaks the spec is replayed as recorded up to the break, then sent raw: the
            # recorded server closed there, the target must too.  A broken server stream cannot be replayed.
            if dc.error is not None and dc.error_direction != "client->server":
                raise ReplayError(f"{path}: connection {dc.conn.index}: the recorded server's replies do not decode "
                                  f"({dc.error}); run `ggml-rpc decode` for details")
            if dc.protocol is None and dc.error is None:
                raise ReplayError(f"{path}: connection {dc.conn.index}: protocol version unknown (no HELLO reply)")
        out.append(LoadedCapture(str(path), conns))
    return out


def source_protocol(captures: Sequence[LoadedCapture], default: Protocol | None = None) -> Protocol:
    """The one version the captures speak (ReplayError if they mix versions); ``default`` when no connection got
    as far as a HELLO reply."""
    versions = {dc.protocol.label: dc.protocol for cap in captures for dc in cap.connections
                if dc.protocol is not None}
    if not versions:
        if default is not None:
            return default
        raise ReplayError("no connection of the captures names its version (no HELLO reply): give --proto or --as")
    if len(versions) > 1:
        raise ReplayError(f"the captures mix protocol versions ({', '.join(sorted(versions))}): replay them "
                          "separately")
    return next(iter(versions.values()))


# ---- relocation --------------------------------------------------------------------------------------------------


class Relocator:
    """Old (captured) buffer handles and bases to the target's, for one connection."""

    def __init__(self) -> None:
        self.handles: dict[int, int] = {}
        self.bases: dict[int, tuple[int, int]] = {}  # old handle -> (old base, new base)
        self._arrays: tuple[np.ndarray, ...] | None = None

    def buffer(self, old: int, new: int) -> None:
        if old:
            self.handles[old] = new
            self.bases.pop(old, None)
            self._arrays = None

    def base(self, old_handle: int, old_base: int, new_base: int) -> None:
        self.bases[old_handle] = (old_base, new_base)
        self._arrays = None

    def handle(self, old: int) -> int:
        return self.handles.get(old, old)

    def tensor(self, t: dict[str, Any]) -> dict[str, Any]:
        old = t["buffer"]
        if not old or old not in self.handles:
            return t
        t = dict(t)
        t["buffer"] = self.handles[old]
        if t["data"] and old in self.bases:
            old_base, new_base = self.bases[old]
            t["data"] = (new_base + (t["data"] - old_base)) & 0xFFFFFFFFFFFFFFFF
        return t

    def fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A copy of a request's fields with every tensor, handle and tensor list relocated."""
        out = dict(fields)
        for key, value in fields.items():
            if key == "remote_ptr":
                out[key] = self.handle(value)
            elif isinstance(value, dict) and "buffer" in value:
                out[key] = self.tensor(value)
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                out[key] = [self.tensor(v) for v in value]
            elif key == "tensors" and isinstance(value, np.ndarray):
                out[key] = self.tensor_array(value)
        return out

    def tensor_array(self, tensors: np.ndarray) -> np.ndarray:
        """GRAPH_COMPUTE's tensors relocated in one pass (a new array; the capture is not touched)."""
        # Copied as raw bytes: numpy copies a packed structured array field by field, several times slower.
        out = np.ascontiguousarray(tensors).view(np.uint8).copy().view(tensors.dtype)
        if not self.handles or not len(out):
            return out
        if self._arrays is None:
            keys = np.array(sorted(self.handles), dtype=np.uint64)
            new = np.array([self.handles[int(k)] for k in keys], dtype=np.uint64)
            has_base = np.array([int(k) in self.bases for k in keys], dtype=bool)
            old_base = np.array([self.bases.get(int(k), (0, 0))[0] for k in keys], dtype=np.uint64)
            new_base = np.array([self.bases.get(int(k), (0, 0))[1] for k in keys], dtype=np.uint64)
            self._arrays = (keys, new, has_base, old_base, new_base)
        keys, new, has_base, old_base, new_base = self._arrays
        buf = out["buffer"]
        idx = np.searchsorted(keys, buf)
        idx_c = np.minimum(idx, len(keys) - 1)
        known = (idx < len(keys)) & (keys[idx_c] == buf)
        data = out["data"]
        move = known & (data != 0) & has_base[idx_c]
        pos = idx_c[move]
        with np.errstate(over="ignore"):
            data[move] = new_base[pos] + (data[move] - old_base[pos])
        buf[known] = new[idx_c[known]]
        return out


# ---- comparison helpers --------------------------------------------------------------------------------------------


def nmse(expected: np.ndarray, got: np.ndarray) -> float:
    """Normalised mean squared error sum((g-e)^2) / sum(e^2) (0 when both are all zero); NaN/inf must match."""
    e = expected.astype(np.float64)
    g = got.astype(np.float64)
    fe, fg = np.isfinite(e), np.isfinite(g)
    if not np.array_equal(fe, fg):
        return float("inf")
    if not np.all(fe):
        same = (e[~fe] == g[~fe]) | (np.isnan(e[~fe]) & np.isnan(g[~fe]))
        if not np.all(same):
            return float("inf")
        e, g = e[fe], g[fe]
    den = float(np.dot(e, e))
    num = float(np.dot(g - e, g - e))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def _first_difference(a: memoryview, b: memoryview) -> str:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    at = int(diff[0]) if len(diff) else n
    return f"first difference at byte {at} ({len(diff)} differing bytes of {n})"


def _same_bytes(a: memoryview | bytes, b: memoryview | bytes) -> bool:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    return x.shape == y.shape and bool(np.array_equal(x, y))


def _label(t: dict[str, Any]) -> str:
    return tensor_name(t["name"]) or f"id={t['id']:#x}"


# ---- the replayer --------------------------------------------------------------------------------------------------


class _TargetCache:
    """What the target's hash cache holds, as far as this replay can know: payloads its rule saved."""

    def __init__(self, protocol: Protocol) -> None:
        self.rule = protocol.cache_rule
        self.hashes: set[int] = set()
        self._unhashed: list[memoryview] = []

    def sent(self, data: memoryview | None, cache_flag: int) -> None:
        n = data.nbytes if data is not None else 0
        if data is not None and self.rule.server_saves(n, cache_flag):
            self._unhashed.append(data)

    def holds(self, digest: int) -> bool:
        if digest in self.hashes:
            return True
        while self._unhashed:
            self.hashes.add(fnv1a64(self._unhashed.pop()))
        return digest in self.hashes


class Replayer:
    """Replays decoded captures against one server at ``host:port``."""

    def __init__(
        self,
        captures: Sequence[LoadedCapture],
        host: str,
        port: int,
        *,
        as_protocol: Protocol | None = None,
        nmse_tolerance: float = DEFAULT_NMSE,
        timeout: float = 120.0,
        until_compute: bool = False,
    ) -> None:
        self.captures = list(captures)
        self.until_compute = until_compute
        # With --as, captures of different versions may be mixed: each connection is rewritten from its own.
        self.source = source_protocol(self.captures, as_protocol) if as_protocol is None else as_protocol
        self.target = as_protocol or self.source
        labels = sorted({dc.protocol.label for cap in self.captures for dc in cap.connections
                         if dc.protocol is not None}) or [self.source.label]
        self.host, self.port = host, port
        self.tolerance = nmse_tolerance
        self.timeout = timeout
        self.cache = _TargetCache(self.target)
        self._by_hash: dict[int, memoryview] | None = None
        self.report = ReplayReport(target=f"{host}:{port}", source_versions=labels,
                                   target_version=self.target.label)

    # -- cache data supply --

    def _payloads(self) -> Iterator[memoryview]:
        for cap in self.captures:
            for dc in cap.connections:
                for req in dc.requests:
                    if req.command is Command.SET_TENSOR and req.data is not None and req.data.nbytes:
                        yield req.data

    def _data_for(self, digest: int) -> memoryview | None:
        """A SET_TENSOR payload of any loaded capture with this hash (all payloads are hashed once, when first
        needed: only replays that need a cache state the target lacks pay for it)."""
        if self._by_hash is None:
            self._by_hash = {}
            for data in self._payloads():
                self._by_hash.setdefault(fnv1a64(data), data)
        return self._by_hash.get(digest)

    # -- running --

    def run(self) -> ReplayReport:
        start = time.perf_counter()
        for cap in self.captures:
            for dc in cap.connections:
                self.report.connections += 1
                self._connection(cap.path, dc)
        self.report.seconds = time.perf_counter() - start
        return self.report

    def _mismatch(self, path: str, dc: DecodedConnection, req: Request, kind: str, expected: str, got: str) -> None:
        self.report.mismatches.append(Mismatch(path, dc.conn.index, req.index, req.command.name, kind, expected, got))

    def _connection(self, path: str, dc: DecodedConnection) -> None:
        replies = {id(r.request): r for r in dc.replies}
        reloc = Relocator()
        computed = False
        # Regions written since the last graph ran (recorded address -> bytes): reading one back is exact.
        written: dict[int, int] = {}
        last_miss: Request | None = None
        try:
            client = RpcClient(socket.create_connection((self.host, self.port), timeout=self.timeout),
                               self.target)
        except OSError as exc:
            raise ReplayError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with client:
            for req in dc.requests:
                cmd = req.command
                if self.until_compute and cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                    left = len(dc.requests) - req.index
                    self.report.notes.append(f"{path} connection {dc.conn.index}: stopped at message {req.index} "
                                             f"({cmd.name}), {left} request(s) not replayed (--until-compute)")
                    return
                self.report.requests += 1
                rec = replies.get(id(req))
                fields = reloc.fields(req.fields)
                data = req.data
                if cmd is Command.SET_TENSOR:
                    fields = self._set_tensor_fields(fields, last_miss, req, dc.protocol)
                    self.cache.sent(data, self._flag(fields))
                    if computed and data is not None:
                        written[req.fields["tensor"]["data"] + req.fields["offset"]] = data.nbytes
                last_miss = None
                if cmd is Command.SET_TENSOR_HASH and rec is not None and rec.fields["result"] == 1 \
                        and not self.cache.holds(req.fields["hash"]):
                    if not self._supply(path, dc, req, fields, client):
                        return
                    continue
                spec = self.target.spec(cmd)
                if spec is None:
                    self._mismatch(path, dc, req, "exact", f"a {cmd.name} request", f"no such command in "
                                   f"{self.target.label}")
                    return
                parts = request_parts(self.target, cmd, fields, data)
                try:
                    client.send_raw(parts)
                    self.report.bytes_sent += sum(memoryview(p).nbytes for p in parts)
                    if cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
                        computed = True
                        written.clear()
                    if not spec.has_reply:
                        continue
                    expected_size = spec.reply_size(req.fields)
                    if rec is None:
                        self.report.compared["close"] += 1
                        if not client.expect_closed(timeout=min(self.timeout, 5.0)):
                            self._mismatch(path, dc, req, "close", "the server to close the connection (as "
                                           "recorded)", "a reply or an open connection")
                        return
                    body = client.recv_reply_raw(max_size=max(expected_size, 1 << 16))
                except ConnectionClosed as exc:
                    if self._recorded_close_from(dc, req, replies):
                        self.report.compared["close"] += 1  # closed a little earlier than we could ask: as recorded
                        return
                    self._mismatch(path, dc, req, "transport", "a reply" if rec is not None else "no reply",
                                   f"connection closed ({exc})")
                    return
                except OSError as exc:
                    self._mismatch(path, dc, req, "transport", "a reply", f"socket error ({exc})")
                    return
                except ProtocolError as exc:  # a size header no reply of this command can have (not an RPC server?)
                    self._mismatch(path, dc, req, "exact", f"a {expected_size}-byte reply", str(exc))
                    return
                self.report.bytes_received += REPLY_HEADER_SIZE + len(body)
                if len(body) != expected_size:
                    self._mismatch(path, dc, req, "exact", f"a {expected_size}-byte reply", f"{len(body)} bytes")
                    return
                got = memoryview(body)
                fresh = cmd is Command.GET_TENSOR and written.get(
                    req.fields["tensor"]["data"] + req.fields["offset"], 0) >= req.fields["size"]
                self._compare(path, dc, req, rec, fields, got, computed and not fresh, reloc)
                if cmd is Command.SET_TENSOR_HASH:
                    hit = got[0] != 0
                    if not hit:
                        last_miss = req
            if dc.error is not None:
                self._send_broken_tail(path, dc, client)

    def _send_broken_tail(self, path: str, dc: DecodedConnection, client: RpcClient) -> None:
        """Send the client bytes from the first request that does not decode, and expect the server to close."""
        last = dc.requests[-1] if dc.requests else None
        start = last.offset + last.wire_size if last is not None else 0
        tail = memoryview(dc.conn.c2s.data)[start:]
        self.report.requests += 1
        self.report.compared["close"] += 1
        try:
            client.send_raw(tail)
            self.report.bytes_sent += tail.nbytes
        except ConnectionClosed:
            return  # closed while we were still sending: what the recorded server did
        if not client.expect_closed(timeout=min(self.timeout, 5.0)):
            assert dc.error is not None
            self.report.mismatches.append(Mismatch(
                path, dc.conn.index, len(dc.requests), dc.error.command or "?", "close",
                f"the server to close on bytes that break the spec ({dc.error.message})",
                "a reply or an open connection"))

    def _recorded_close_from(self, dc: DecodedConnection, req: Request, replies: dict[int, Reply]) -> bool:
        """Did the recorded server close at or before ``req``: no reply recorded from here on, and a later request
        that should have had one got none (or the client stream breaks the spec)?"""
        later = dc.requests[req.index :]
        if any(id(r) in replies for r in later):
            return False
        if dc.error is not None and dc.error_direction == "client->server":
            return True
        return any((spec := self.target.spec(r.command)) is not None and spec.has_reply for r in later)

    def _flag(self, fields: dict[str, Any]) -> int:
        """The cache flag of a SET_TENSOR in the target's layout (0 where the layout has none)."""
        name = self.target.cache_rule.flag_field
        return int(fields.get(name, 0)) if name else 0

    def _set_tensor_fields(self, fields: dict[str, Any], last_miss: Request | None, req: Request,
                           dc_protocol: Protocol | None) -> dict[str, Any]:
        """SET_TENSOR in the target's layout (cache_flag added or dropped for a cross-version replay)."""
        flag_field = self.target.cache_rule.flag_field
        source = dc_protocol or self.source
        if source.cache_rule.flag_field == flag_field:
            return fields
        fields = dict(fields)
        if flag_field is None:
            fields.pop(source.cache_rule.flag_field, None)
        else:
            fields[flag_field] = int(last_miss is not None and follows_miss(last_miss.fields, req.fields))
        return fields

    def _supply(self, path: str, dc: DecodedConnection, req: Request, fields: dict[str, Any],
                client: RpcClient) -> bool:
        """The capture hit a cache entry the target cannot hold: send the data instead (or report why not)."""
        digest = req.fields["hash"]
        data = self._data_for(digest)
        name = _label(req.fields["tensor"])
        if data is None:
            self._mismatch(path, dc, req, "exact", f"a cache hit for {digest:016x} ({name})",
                           "a target cache without it, and no loaded capture holds data with that hash to supply")
            return False
        self.report.notes.append(
            f"{path} connection {dc.conn.index} message {req.index}: the capture hits cache entry {digest:016x} "
            f"({name}) that the target cannot hold yet; sent its {data.nbytes} bytes with SET_TENSOR instead")
        set_fields = {"tensor": fields["tensor"], "offset": fields["offset"]}
        if self.target.cache_rule.flag_field:
            set_fields[self.target.cache_rule.flag_field] = 1
        self.cache.sent(data, self._flag(set_fields))
        try:
            parts = request_parts(self.target, Command.SET_TENSOR, set_fields, data)
            client.send_raw(parts)
            self.report.bytes_sent += sum(memoryview(p).nbytes for p in parts)
        except ConnectionClosed as exc:
            self._mismatch(path, dc, req, "transport", "the supplied data to be accepted", f"connection closed "
                           f"({exc})")
            return False
        return True

    def _compare(self, path: str, dc: DecodedConnection, req: Request, rec: Reply, fields: dict[str, Any],
                 got: memoryview, computed: bool, reloc: Relocator) -> None:
        cmd = req.command
        spec = self.target.spec(cmd)
        assert spec is not None and spec.reply
        if cmd is Command.GET_TENSOR:
            assert rec.data is not None
            self._compare_read(path, dc, req, rec.data, got, computed)
            return
        got_fields = flat_layout(spec.reply.schema).unpack(got)  # type: ignore[union-attr]
        want = rec.fields
        if cmd is Command.ALLOC_BUFFER:
            reloc.buffer(want["remote_ptr"], got_fields["remote_ptr"])
            self._exact(path, dc, req, "a successful allocation" if want["remote_ptr"] else "a failed allocation",
                        "success" if got_fields["remote_ptr"] else "failure (remote_ptr 0)",
                        bool(want["remote_ptr"]) == bool(got_fields["remote_ptr"]))
            return
        if cmd is Command.BUFFER_GET_BASE:
            reloc.base(req.fields["remote_ptr"], want["base_ptr"], got_fields["base_ptr"])
        if cmd in RECORDED_ONLY:
            self.report.compared["recorded"] += 1
            return
        if cmd is Command.HELLO:
            version = f"{self.target.version[0]}.{self.target.version[1]}"
            got_v = f"{got_fields['major']}.{got_fields['minor']}"
            self._exact(path, dc, req, f"version {version}.x", f"version {got_v}.{got_fields['patch']}",
                        version == got_v)
            return
        if cmd is Command.SET_TENSOR_HASH:
            expect_hit = bool(want["result"]) or self.cache.holds(req.fields["hash"])
            hit = bool(got_fields["result"])
            why = "" if expect_hit == bool(want["result"]) else " (the replay saved this payload earlier)"
            self._exact(path, dc, req, ("hit" if expect_hit else "miss") + why, "hit" if hit else "miss",
                        hit == expect_hit)
            return
        self._exact(path, dc, req, str(dict(want)), str(dict(got_fields)), dict(want) == dict(got_fields))

    def _exact(self, path: str, dc: DecodedConnection, req: Request, expected: str, got: str, ok: bool) -> None:
        self.report.compared["exact"] += 1
        if not ok:
            self._mismatch(path, dc, req, "exact", expected, got)

    def _compare_read(self, path: str, dc: DecodedConnection, req: Request, want: memoryview, got: memoryview,
                      computed: bool) -> None:
        t = req.fields["tensor"]
        if not computed:
            self.report.compared["exact"] += 1
            if not _same_bytes(want, got):
                self._mismatch(path, dc, req, "exact", f"the {want.nbytes} bytes written to {_label(t)}",
                               _first_difference(want, got))
            return
        self.report.compared["computed"] += 1
        if _same_bytes(want, got):
            return
        dtype = _FLOAT_TYPES.get(t["type"])
        if dtype is None or want.nbytes % dtype.itemsize:
            self._mismatch(path, dc, req, "computed", f"the recorded {want.nbytes} bytes of {_label(t)} "
                           "(not a float type: exact)", _first_difference(want, got))
            return
        err = nmse(np.frombuffer(want, dtype=dtype), np.frombuffer(got, dtype=dtype))
        self.report.worst_nmse = max(self.report.worst_nmse, err)
        if not err <= self.tolerance:
            self._mismatch(path, dc, req, "computed", f"{_label(t)} within NMSE {self.tolerance:g}",
                           f"NMSE {err:.3g}")


def replay(
    paths: Sequence[str | Path],
    host: str,
    port: int,
    *,
    as_protocol: Protocol | None = None,
    protocol: Protocol | None = None,
    nmse_tolerance: float = DEFAULT_NMSE,
    timeout: float = 120.0,
    until_compute: bool = False,
) -> ReplayReport:
    """Decode ``paths`` and replay them against ``host:port``."""
    captures = load_captures(paths, protocol)
    return Replayer(captures, host, port, as_protocol=as_protocol, nmse_tolerance=nmse_tolerance,
                    timeout=timeout, until_compute=until_compute).run()
