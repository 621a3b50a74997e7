"""One breaker per conformance check: a server that breaks exactly the rule the check enforces.

``BREAKERS[check_id]`` builds the breaker; the test runs the check against the reference server behind it and
expects a failure with evidence.  A new check without an entry here fails that test.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from faulty import (
    AcceptBad,
    Act,
    Breaker,
    Conn,
    Dies,
    DiesOnLostReply,
    Inject,
    Msg,
    RewriteReply,
    RewriteRequest,
    fake_reply,
)
from ggml_rpc.conformance.checks.shadow import SHADOW_CHECKS, in_class
from ggml_rpc.conformance.harness.shadow import written_tensor
from ggml_rpc.spec import (
    HASH_THRESHOLD,
    TYPES,
    Command,
    GgmlOp,
    GgmlType,
    cache_file_name,
    encode_request,
    fnv1a64,
    make_tensor,
    tensor_nbytes,
)
from ggml_rpc.spec.checks import region_2d_span
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.geometry import Span, classify
from ggml_rpc.spec.messages import Shape

C = Command
U64 = (1 << 64) - 1


# ---- predicates over one request ---------------------------------------------------------------------------------


def tensors_of(msg: Msg) -> list[dict[str, Any]]:
    f = msg.fields or {}
    out = [f[k] for k in ("tensor", "src", "dst", "op") if isinstance(f.get(k), dict)]
    out += [t for t in f.get("srcs", []) if isinstance(t, dict) and t.get("id")]
    return out


def bad_type(t: dict) -> bool:
    return t["type"] >= len(TYPES)


def removed_type(t: dict) -> bool:
    return t["type"] < len(TYPES) and TYPES[t["type"]].removed


def region(conn: Conn, t: dict) -> tuple[int, int] | None:
    """(start, end) of a known buffer holding tensor ``t`` (by handle), or None."""
    entry = conn.buffers.get(t["buffer"])
    if entry is None or not entry[1]:
        return None
    return entry[1], entry[1] + entry[0]


def nbytes(t: dict) -> int:
    return tensor_nbytes(t) if not bad_type(t) and not removed_type(t) else 0


def outside(conn: Conn, t: dict) -> bool:
    r = region(conn, t)
    return r is not None and (t["data"] < r[0] or t["data"] + nbytes(t) > r[1])


def unknown_buffer(conn: Conn, t: dict) -> bool:
    return t["buffer"] not in conn.buffers


def cmd_is(*cmds: Command) -> Callable[[Conn, Msg], bool]:
    return lambda conn, msg: msg.cmd in cmds


def data_len(msg: Msg) -> int:
    return len(msg.data) if msg.data is not None else 0


def _span_outside(conn: Conn, fields: dict, length: int) -> bool:
    """``length`` bytes at the tensor's data + offset leave its (known) buffer."""
    t = fields["tensor"]
    r = region(conn, t)
    if r is None:
        return False
    start = t["data"] + fields["offset"]
    return start < r[0] or start >= r[1] or length > r[1] - start


def set_region_outside(conn: Conn, msg: Msg) -> bool:
    return msg.cmd == C.SET_TENSOR and msg.fields is not None and _span_outside(conn, msg.fields, data_len(msg))


def get_region_outside(conn: Conn, msg: Msg) -> bool:
    return msg.cmd == C.GET_TENSOR and msg.fields is not None and _span_outside(conn, msg.fields, msg.fields["size"])


def graph_counts(msg: Msg) -> tuple[int, int] | None:
    """(n_nodes, n_tensors) from a raw GRAPH_COMPUTE payload, as far as it goes."""
    p = msg.payload
    if len(p) < 8:
        return None
    n_nodes = struct.unpack_from("<I", p, 4)[0]
    end = 8 + 8 * n_nodes
    if len(p) < end + 4:
        return n_nodes, -1
    return n_nodes, struct.unpack_from("<I", p, end)[0]


def graph_tensors(msg: Msg) -> tuple[list[int], np.ndarray] | None:
    if msg.cmd != C.GRAPH_COMPUTE or msg.fields is None:
        return None
    return [int(n) for n in msg.fields["nodes"]], msg.fields["tensors"]


# ---- reply rewriting helpers --------------------------------------------------------------------------------------


def put(fmt: str, value: int, offset: int = 0) -> Callable[[Conn, Msg, bytes], bytes]:
    def fn(conn: Conn, msg: Msg, body: bytes) -> bytes:
        out = bytearray(body)
        struct.pack_into(fmt, out, offset, value)
        return bytes(out)

    return fn


def after_first(fn: Callable[[Conn, Msg, bytes], bytes]) -> Callable[[Conn, Msg, bytes], bytes]:
    """Only on connections after the runner's own handshake (connection 1), so the run can start."""
    return lambda conn, msg, body: fn(conn, msg, body) if conn.index > 1 else body


def result(value: int) -> bytes:
    return REPLY_HEADER.pack(1) + bytes([value])


# ---- stateful breakers ---------------------------------------------------------------------------------------------


class Stateful(Breaker):
    """A breaker given as a function of (conn, msg) returning an Act or None."""

    def __init__(self, fn: Callable[[Conn, Msg], Act | None]) -> None:
        self.fn = fn

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        return self.fn(conn, msg)


class SharedUpstream(Breaker):
    """Every client connection is multiplexed onto one server connection: buffers outlive and cross clients."""

    shared_upstream = True


class MemoryCache(Breaker):
    """A server whose cache lives in memory: entries answer by hash, but no file named after the hash exists."""

    def __init__(self) -> None:
        self.entries: dict[int, bytes] = {}

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        f = msg.fields
        if f is None:
            return None
        rule = conn.protocol.cache_rule
        if msg.cmd == C.SET_TENSOR and msg.data is not None and rule.server_saves(len(msg.data),
                                                                                   f.get(rule.flag_field or "", 0)):
            self.entries[fnv1a64(msg.data)] = msg.data
            parts = split_set(conn, msg)
            return Act(forward=parts[0], then_upstream=tuple(parts[1:]))
        if msg.cmd == C.SET_TENSOR_HASH and f["hash"] in self.entries:
            data = self.entries[f["hash"]]
            fields = {"tensor": f["tensor"], "offset": f["offset"]}
            if rule.flag_field:
                fields[rule.flag_field] = 0
            return Act(forward=encode_request(conn.protocol, C.SET_TENSOR, fields, data), answer=result(1))
        return None


def split_set(conn: Conn, msg: Msg) -> list[bytes]:
    """A SET_TENSOR as two unflagged halves: the same bytes land, but no half is cache-eligible."""
    assert msg.fields is not None and msg.data is not None
    half = len(msg.data) // 2
    out = []
    for start, chunk in ((0, msg.data[:half]), (half, msg.data[half:])):
        fields = {"tensor": msg.fields["tensor"], "offset": msg.fields["offset"] + start}
        if conn.protocol.cache_rule.flag_field:
            fields[conn.protocol.cache_rule.flag_field] = 0
        out.append(encode_request(conn.protocol, C.SET_TENSOR, fields, chunk))
    return out


def save_file(conn: Conn, data: bytes) -> None:
    """Put an entry in the server's cache directory, as a server with a different save rule would."""
    assert conn.cache_dir is not None
    path = Path(conn.cache_dir) / cache_file_name(fnv1a64(data))
    path.write_bytes(data)


def v6_saves_also(pred: Callable[[int], bool]) -> Breaker:
    def fn(conn: Conn, msg: Msg) -> Act | None:
        if msg.cmd == C.SET_TENSOR and msg.data is not None and pred(len(msg.data)):
            save_file(conn, msg.data)
        return None

    return Stateful(fn)


def flag_fn(pred: Callable[[int, int], bool], new: int) -> Breaker:
    """v7: rewrite cache_flag to ``new`` on SET_TENSORs where pred(flag, n) holds."""
    def when(conn: Conn, msg: Msg) -> bool:
        return (msg.cmd == C.SET_TENSOR and msg.fields is not None
                and pred(msg.fields["cache_flag"], data_len(msg)))

    def change(conn: Conn, msg: Msg) -> tuple[dict, bytes | None]:
        assert msg.fields is not None
        return {**msg.fields, "cache_flag": new}, msg.data

    return RewriteRequest(when, change)


def per_conn_hashes() -> Breaker:
    """Cache entries answer only on the connection that saved them."""

    def fn(conn: Conn, msg: Msg) -> Act | None:
        f = msg.fields
        if f is None:
            return None
        saved = conn.notes.setdefault("saved", set())
        if msg.cmd == C.SET_TENSOR and msg.data is not None and f.get("cache_flag"):
            saved.add(fnv1a64(msg.data))
        if msg.cmd == C.SET_TENSOR_HASH and f["hash"] not in saved:
            return Act(forward=None, answer=result(0))
        return None

    return Stateful(fn)


def write_then_zero(pred: Callable[[Conn, Msg], bool]) -> Breaker:
    """Requests matching pred are forwarded, then the tensor they name is zeroed (MEMSET_TENSOR upstream)."""

    def fn(conn: Conn, msg: Msg) -> Act | None:
        if msg.fields is None or not pred(conn, msg):
            return None
        t = msg.fields["tensor"]
        n = nbytes(t)
        zero = encode_request(conn.protocol, C.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": n, "value": 0})
        return Act(forward=msg.raw, then_upstream=(zero,))

    return Stateful(fn)


class CorruptOutputs(Breaker):
    """Results of graphs using one of ``ops`` come back with their signs flipped."""

    def __init__(self, ops: Iterable[GgmlOp]) -> None:
        self.ops = {int(o) for o in ops}

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        g = graph_tensors(msg)
        if g is not None:
            tensors = g[1]
            hit = tensors["data"][np.isin(tensors["op"], list(self.ops))]
            conn.notes.setdefault("corrupt", set()).update(int(d) for d in hit)
        return None

    def reply(self, conn: Conn, msg: Msg, body: bytes) -> bytes:
        if msg.cmd != C.GET_TENSOR or msg.fields is None:
            return body
        t = msg.fields["tensor"]
        if t["data"] not in conn.notes.get("corrupt", set()):
            return body
        width = {int(GgmlType.F32): 4, int(GgmlType.F16): 2}.get(t["type"], 1)
        out = np.frombuffer(body, dtype=np.uint8).copy()
        out[width - 1 :: width] ^= 0x80
        return out.tobytes()


def close_on(pred: Callable[[Conn, Msg], bool]) -> Breaker:
    return Stateful(lambda conn, msg: Act(forward=None, close=True) if pred(conn, msg) else None)


def no_graph_yet(conn: Conn, msg: Msg) -> bool:
    if msg.cmd == C.GRAPH_COMPUTE:
        conn.notes["graphs"] = conn.notes.get("graphs", 0) + 1
    return msg.cmd == C.GRAPH_RECOMPUTE and not conn.notes.get("graphs")


def _graph_pred(check: Callable[[list[int], np.ndarray], bool]) -> Callable[[Conn, Msg], bool]:
    def pred(conn: Conn, msg: Msg) -> bool:
        g = graph_tensors(msg)
        return g is not None and check(*g)

    return pred


def _unknown_node(nodes: list[int], tensors: np.ndarray) -> bool:
    ids = set(tensors["id"].tolist())
    return any(n and n not in ids for n in nodes)


def _unresolved_src(nodes: list[int], tensors: np.ndarray) -> bool:
    ids = set(tensors["id"].tolist()) | {0}
    return any(s not in ids for row in tensors["src"].tolist() for s in row)


def _fixed_wrong_size(conn: Conn, msg: Msg) -> bool:
    spec = conn.protocol.spec(msg.cmd) if msg.cmd != C.NONE else None
    return spec is not None and spec.request.shape is Shape.FIXED and msg.size != spec.request.header_size


def _device_ge_count(conn: Conn, msg: Msg) -> bool:
    f = msg.fields or {}
    return "device" in f and f["device"] >= 1


def _get_past_nbytes(conn: Conn, msg: Msg) -> bool:
    f = msg.fields
    return (msg.cmd == C.GET_TENSOR and f is not None and not get_region_outside(conn, msg)
            and f["offset"] + f["size"] > nbytes(f["tensor"]))


def _set_past_nbytes(conn: Conn, msg: Msg) -> bool:
    f = msg.fields
    return (msg.cmd == C.SET_TENSOR and f is not None and not set_region_outside(conn, msg)
            and f["offset"] + data_len(msg) > nbytes(f["tensor"]))


def _memset_past(conn: Conn, msg: Msg) -> bool:
    f = msg.fields
    if msg.cmd != C.MEMSET_TENSOR or f is None:
        return False
    n = nbytes(f["tensor"])
    return f["offset"] > n or f["size"] > n - f["offset"]


def _copy_overflow(conn: Conn, msg: Msg) -> bool:
    f = msg.fields
    if msg.cmd != C.COPY_TENSOR or f is None:
        return False
    r = region(conn, f["dst"])
    return r is not None and f["dst"]["data"] + nbytes(f["src"]) > r[1]


def _graph_data_without_buffer(nodes: list[int], tensors: np.ndarray) -> bool:
    return bool(np.any((tensors["buffer"] == 0) & (tensors["data"] != 0)))


def _short_nodes(conn: Conn, msg: Msg) -> bool:
    c = graph_counts(msg) if msg.cmd == C.GRAPH_COMPUTE else None
    return c is not None and c[1] == -1


def _short_tensors(conn: Conn, msg: Msg) -> bool:
    c = graph_counts(msg) if msg.cmd == C.GRAPH_COMPUTE else None
    return c is not None and c[1] >= 0 and len(msg.payload) < 12 + 8 * c[0] + 296 * c[1]


def _rewrite(cmd: Command, when: Callable[[dict, Msg], bool], change: Callable[[dict, Msg], tuple[dict, Any]]
             ) -> Breaker:
    return RewriteRequest(lambda conn, msg: msg.cmd == cmd and msg.fields is not None and when(msg.fields, msg),
                          lambda conn, msg: change(dict(msg.fields or {}), msg))


def _flip_first(f: dict, msg: Msg) -> tuple[dict, bytes]:
    data = bytearray(msg.data or b"")
    data[0] ^= 0xFF
    return f, bytes(data)


def _align_down(f: dict, msg: Msg) -> tuple[dict, bytes | None]:
    t = dict(f["tensor"])
    t["data"] -= t["data"] % 4
    return {**f, "tensor": t}, msg.data


def _base_drift(conn: Conn, msg: Msg, body: bytes) -> bytes:
    k = conn.notes["bases"] = conn.notes.get("bases", 0) + 1
    return struct.pack("<Q", struct.unpack("<Q", body)[0] + 64 * k)


def _hello_field(offset: int, value: int) -> Breaker:
    def fn(conn: Conn, msg: Msg, body: bytes) -> bytes:
        out = bytearray(body)
        out[offset] = value
        return bytes(out)

    return RewriteReply(C.HELLO, after_first(fn))


def _hello_flaky(conn: Conn, msg: Msg, body: bytes) -> bytes:
    if conn.index > 1 and conn.index % 3 == 0:
        return body[:2] + bytes([9]) + body[3:]
    return body


def _last_byte_flipped(conn: Conn, msg: Msg, body: bytes) -> bytes:
    if msg.fields and msg.fields["size"] >= 1 << 20:
        return body[:-1] + bytes([body[-1] ^ 0xFF])
    return body


def _hash_hit_outside(conn: Conn, msg: Msg) -> bool:
    f = msg.fields
    if msg.cmd != C.SET_TENSOR_HASH or f is None or conn.cache_dir is None:
        return False
    path = Path(conn.cache_dir) / cache_file_name(f["hash"])
    r = region(conn, f["tensor"])
    if r is None or not path.is_file():
        return False
    start = f["tensor"]["data"] + f["offset"]
    return start + path.stat().st_size > r[1]


def _zeros_to_pointers(conn: Conn, msg: Msg, body: bytes) -> bytes:
    """Every all-zero word of a read becomes a heap pointer: what an allocator's stale chunk hands out."""
    out = bytearray(body)
    for i in range(0, len(out) - 7, 8):
        if not any(out[i:i + 8]):
            struct.pack_into("<Q", out, i, 0x0000_7FAB_F11F_1CC0)
    return bytes(out)


def _other_layout_accepted(conn: Conn, msg: Msg) -> bool:
    """A SET_TENSOR whose region leaves the buffer (v6 layout read by v7) or the tensor (v7 layout read by v6)."""
    return set_region_outside(conn, msg) or _set_past_nbytes(conn, msg)


def _v6_never_saves(conn: Conn, msg: Msg) -> Act | None:
    if msg.cmd == C.SET_TENSOR and data_len(msg) > HASH_THRESHOLD:
        parts = split_set(conn, msg)
        return Act(forward=parts[0], then_upstream=tuple(parts[1:]))
    return None


BREAKERS: dict[str, Callable[[], Breaker]] = {
    # handshake
    "HELLO-001": lambda: RewriteReply(C.HELLO, after_first(lambda c, m, body: body[:24])),
    "HELLO-002": lambda: _hello_field(0, 6),
    "HELLO-003": lambda: _hello_field(3, 1),
    "HELLO-004": lambda: _hello_field(4, 1),
    "HELLO-005": lambda: RewriteReply(C.HELLO, _hello_flaky),
    "HELLO-006": lambda: AcceptBad(lambda conn, msg: conn.hellos == 0 and msg.cmd != C.HELLO),
    "HELLO-007": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.HELLO and _fixed_wrong_size(conn, msg)),
    "HELLO-008": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.HELLO and conn.hellos >= 2),
    "HELLO-009": lambda: RewriteReply(C.DEVICE_COUNT, put("<I", 0)),
    # framing and bad input
    "FRAME-001": lambda: AcceptBad(lambda conn, msg: msg.cmd >= conn.protocol.command_count),
    "FRAME-002": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.NONE),
    "FRAME-003": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.GET_DEVICE_SUPPORTS_OP),
    "FRAME-004": lambda: AcceptBad(_fixed_wrong_size),
    "FRAME-005": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.DEVICE_COUNT and msg.size != 0),
    "FRAME-006": lambda: AcceptBad(_device_ge_count),
    "FRAME-007": lambda: AcceptBad(lambda conn, msg: msg.cmd in (C.BUFFER_GET_BASE, C.FREE_BUFFER, C.BUFFER_CLEAR)
                                   and msg.fields is not None and msg.fields["remote_ptr"] not in conn.buffers),
    "FRAME-008": lambda: AcceptBad(lambda conn, msg: any(bad_type(t) for t in tensors_of(msg))),
    "FRAME-009": lambda: AcceptBad(lambda conn, msg: any(removed_type(t) for t in tensors_of(msg))),
    "FRAME-010": lambda: AcceptBad(lambda conn, msg: any(outside(conn, t) for t in tensors_of(msg))),
    "FRAME-011": lambda: AcceptBad(lambda conn, msg: any(t["data"] + nbytes(t) > U64 for t in tensors_of(msg))),
    "FRAME-012": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.SET_TENSOR and msg.fields is None),
    "FRAME-013": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.SET_TENSOR and msg.fields is not None
                                   and unknown_buffer(conn, msg.fields["tensor"])),
    "FRAME-014": lambda: AcceptBad(set_region_outside),
    "FRAME-015": lambda: AcceptBad(_set_past_nbytes),
    "FRAME-016": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.GET_TENSOR and msg.fields is not None
                                   and unknown_buffer(conn, msg.fields["tensor"])),
    "FRAME-017": lambda: AcceptBad(get_region_outside),
    "FRAME-018": lambda: AcceptBad(_get_past_nbytes),
    "FRAME-019": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.MEMSET_TENSOR and msg.fields is not None
                                   and unknown_buffer(conn, msg.fields["tensor"])),
    "FRAME-020": lambda: AcceptBad(_memset_past),
    "FRAME-021": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.COPY_TENSOR and msg.fields is not None
                                   and any(unknown_buffer(conn, t) for t in tensors_of(msg))),
    "FRAME-022": lambda: AcceptBad(_copy_overflow),
    "FRAME-023": lambda: close_on(lambda conn, msg: msg.cmd == C.INIT_TENSOR and msg.fields is not None
                                  and msg.fields["tensor"]["buffer"] == 0),
    "FRAME-024": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.GET_ALLOC_SIZE
                                   and any(bad_type(t) for t in tensors_of(msg))),
    "FRAME-025": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.GRAPH_COMPUTE and msg.size < 8),
    "FRAME-026": lambda: AcceptBad(_short_nodes),
    "FRAME-027": lambda: AcceptBad(_short_tensors),
    "FRAME-028": lambda: AcceptBad(_graph_pred(_unknown_node)),
    "FRAME-029": lambda: AcceptBad(_graph_pred(_graph_data_without_buffer)),
    "FRAME-030": lambda: AcceptBad(_graph_pred(_unresolved_src)),
    "FRAME-031": lambda: AcceptBad(_graph_pred(lambda nodes, tensors: 0 in nodes)),
    "FRAME-032": lambda: AcceptBad(no_graph_yet),
    "FRAME-033": lambda: AcceptBad(lambda conn, msg: msg.size > 1 << 40),
    "FRAME-034": lambda: AcceptBad(lambda conn, msg: msg.cmd == C.SET_TENSOR_HASH and msg.fields is not None
                                   and unknown_buffer(conn, msg.fields["tensor"])),
    "FRAME-035": lambda: AcceptBad(_hash_hit_outside),
    "FRAME-036": lambda: Dies(lambda conn, msg: msg.cmd == C.SET_TENSOR and msg.size >= 1 << 63),
    "FRAME-037": lambda: Dies(lambda conn, msg: msg.cmd == C.GRAPH_COMPUTE and msg.size >= 1 << 63),
    # 300,000 tensors are beyond the relay's decode limit: the size alone tells the chain.
    "FRAME-038": lambda: Dies(lambda conn, msg: msg.cmd == C.GRAPH_COMPUTE and msg.size > 64 << 20),
    "FRAME-039": DiesOnLostReply,
    "FRAME-040": lambda: AcceptBad(_other_layout_accepted),
    # data path
    "DATA-001": lambda: RewriteReply(C.ALLOC_BUFFER, lambda c, m, body: body[:8] + struct.pack(
        "<Q", max(0, struct.unpack_from("<Q", body, 8)[0] - 1))),
    "DATA-002": lambda: RewriteReply(C.BUFFER_GET_BASE, _base_drift),
    "DATA-003": lambda: RewriteReply(C.GET_ALIGNMENT, put("<Q", 24)),
    "DATA-004": lambda: RewriteReply(C.GET_MAX_SIZE, put("<Q", 0)),
    "DATA-005": lambda: RewriteReply(C.GET_DEVICE_MEMORY, lambda c, m, body: struct.pack(
        "<QQ", struct.unpack("<QQ", body)[1] + 1, struct.unpack("<QQ", body)[1])),
    "DATA-006": lambda: _rewrite(C.SET_TENSOR, lambda f, m: f["offset"] == 0 and data_len(m) > 0, _flip_first),
    "DATA-007": lambda: _rewrite(C.SET_TENSOR, lambda f, m: f["offset"] == 1, lambda f, m: ({**f, "offset": 0},
                                                                                             m.data)),
    "DATA-008": lambda: _rewrite(C.SET_TENSOR, lambda f, m: f["tensor"]["data"] % 4 != 0, _align_down),
    "DATA-009": lambda: RewriteReply(C.GET_TENSOR, _last_byte_flipped),
    "DATA-010": lambda: close_on(lambda conn, msg: msg.cmd == C.SET_TENSOR and msg.fields is not None
                                 and data_len(msg) == 0),
    "DATA-011": lambda: _rewrite(C.MEMSET_TENSOR, lambda f, m: f["size"] > 0,
                                 lambda f, m: ({**f, "size": f["size"] + 1}, None)),
    "DATA-012": lambda: _rewrite(C.MEMSET_TENSOR, lambda f, m: f["size"] == 0, lambda f, m: ({**f, "size": 1}, None)),
    "DATA-013": lambda: _rewrite(C.BUFFER_CLEAR, lambda f, m: True,
                                 lambda f, m: ({**f, "value": f["value"] ^ 0xFF}, None)),
    "DATA-014": lambda: Stateful(lambda conn, msg: Act(forward=None, answer=result(1))
                                 if msg.cmd == C.COPY_TENSOR else None),
    "DATA-015": lambda: RewriteReply(C.ALLOC_BUFFER, lambda c, m, body: bytes(16) if m.fields and
                                     m.fields["size"] == 0 else body),
    "DATA-016": lambda: Stateful(lambda conn, msg: Act(forward=None) if msg.cmd == C.FREE_BUFFER else None),
    "DATA-017": lambda: RewriteReply(C.GET_ALLOC_SIZE, put("<Q", 1)),
    "DATA-018": lambda: write_then_zero(cmd_is(C.INIT_TENSOR)),
    "DATA-019": lambda: RewriteReply(C.SET_TENSOR_HASH, put("<B", 1)),
    "DATA-020": lambda: RewriteReply(C.GET_DEVICE_SUPPORTS_OP, put("<B", 2)),
    "DATA-021": lambda: Inject(cmd_is(C.FREE_BUFFER), REPLY_HEADER.pack(0)),
    "DATA-022": lambda: Inject(cmd_is(C.BUFFER_CLEAR), REPLY_HEADER.pack(0)),
    "DATA-023": lambda: Inject(cmd_is(C.SET_TENSOR), REPLY_HEADER.pack(0)),
    "DATA-024": lambda: Inject(cmd_is(C.INIT_TENSOR), REPLY_HEADER.pack(0)),
    "DATA-025": lambda: Inject(cmd_is(C.MEMSET_TENSOR), REPLY_HEADER.pack(0)),
    "DATA-026": lambda: Inject(cmd_is(C.GRAPH_COMPUTE), REPLY_HEADER.pack(0)),
    "DATA-027": lambda: Inject(cmd_is(C.GRAPH_RECOMPUTE), REPLY_HEADER.pack(0)),
    "DATA-028": lambda: Stateful(lambda conn, msg: Act(forward=None, answer=REPLY_HEADER.pack(1) + b"\x41")
                                 if msg.cmd == C.GET_TENSOR and msg.fields and msg.fields["size"] == 0 else None),
    "DATA-029": lambda: close_on(lambda conn, msg: msg.cmd == C.ALLOC_BUFFER and msg.fields is not None
                                 and msg.fields["size"] > 1 << 50),
    "DATA-030": lambda: RewriteReply(C.GET_TENSOR, _zeros_to_pointers),
    # cache, v7
    "CACHE-V7-001": lambda: flag_fn(lambda flag, n: flag != 0, 0),
    "CACHE-V7-002": lambda: flag_fn(lambda flag, n: flag == 0 and n > HASH_THRESHOLD, 1),
    "CACHE-V7-003": lambda: flag_fn(lambda flag, n: flag not in (0, 1), 0),
    "CACHE-V7-004": lambda: _rewrite(C.SET_TENSOR_HASH, lambda f, m: f["offset"] != 0,
                                     lambda f, m: ({**f, "offset": 0}, None)),
    "CACHE-V7-005": lambda: write_then_zero(lambda conn, msg: msg.cmd == C.SET_TENSOR and msg.fields is not None
                                            and msg.fields["cache_flag"] == 1 and data_len(msg) > 0),
    "CACHE-V7-006": per_conn_hashes,
    "CACHE-V7-007": MemoryCache,
    # cache, v6
    "CACHE-V6-001": lambda: Stateful(_v6_never_saves),
    "CACHE-V6-002": lambda: v6_saves_also(lambda n: n == HASH_THRESHOLD),
    "CACHE-V6-003": lambda: v6_saves_also(lambda n: 0 < n < HASH_THRESHOLD),
    "CACHE-V6-004": lambda: _rewrite(C.SET_TENSOR_HASH, lambda f, m: f["offset"] != 0,
                                     lambda f, m: ({**f, "offset": 0}, None)),
    "CACHE-V6-005": MemoryCache,
    # isolation
    "ISO-001": SharedUpstream,
    "ISO-002": SharedUpstream,
    "ISO-003": SharedUpstream,
    # compute
    "COMPUTE-001": lambda: CorruptOutputs([GgmlOp.ADD, GgmlOp.SUB, GgmlOp.MUL, GgmlOp.DIV]),
    "COMPUTE-002": lambda: CorruptOutputs([GgmlOp.SQR, GgmlOp.SQRT, GgmlOp.SIN, GgmlOp.COS, GgmlOp.SCALE]),
    "COMPUTE-003": lambda: CorruptOutputs([GgmlOp.UNARY]),
    "COMPUTE-004": lambda: CorruptOutputs([GgmlOp.MUL_MAT]),
    "COMPUTE-005": lambda: CorruptOutputs([GgmlOp.RMS_NORM, GgmlOp.NORM]),
    "COMPUTE-006": lambda: CorruptOutputs([GgmlOp.SOFT_MAX]),
    "COMPUTE-007": lambda: CorruptOutputs([GgmlOp.ROPE]),
    "COMPUTE-008": lambda: CorruptOutputs([GgmlOp.GET_ROWS]),
    "COMPUTE-009": lambda: CorruptOutputs([GgmlOp.CONT, GgmlOp.CPY]),
    "COMPUTE-011": lambda: CorruptOutputs([GgmlOp.GLU]),
    "COMPUTE-012": lambda: CorruptOutputs([GgmlOp.SUM_ROWS, GgmlOp.MEAN, GgmlOp.SUM]),
    "COMPUTE-013": lambda: CorruptOutputs([GgmlOp.REPEAT, GgmlOp.CONCAT]),
    "COMPUTE-014": lambda: CorruptOutputs([GgmlOp.MUL_MAT]),
    "COMPUTE-015": lambda: CorruptOutputs([GgmlOp.SOFT_MAX]),
    "COMPUTE-010": lambda: Stateful(lambda conn, msg: Act(forward=None) if msg.cmd == C.GRAPH_RECOMPUTE else None),
}


# ---- 8.0.0: rows, graph uids, the communicator -------------------------------------------------------------------


def is_(msg: Msg, *cmds: Command) -> bool:
    """The request is one of these commands in the relayed version (ids are per version)."""
    return msg.command in cmds and msg.fields is not None


def rows_outside_tensor(conn: Conn, msg: Msg) -> bool:
    f = msg.fields or {}
    span = region_2d_span(f["size"], f["n_copies"], f["stride"])
    return span is not None and f["offset"] + span > nbytes(f["tensor"])


def _rows_contiguous(conn: Conn, msg: Msg) -> tuple[dict, bytes | None]:
    return {**(msg.fields or {}), "stride": (msg.fields or {})["size"]}, msg.data


def _uids(conn: Conn, msg: Msg, *, on_recompute: Callable[[Conn, Msg, set[int]], Act | None]) -> Act | None:
    """Keeps the uids of the connection's GRAPH_COMPUTEs (and FREE_BUFFERs as uid -1) in its notes."""
    seen: set[int] = conn.notes.setdefault("uids", set())
    if is_(msg, C.GRAPH_COMPUTE):
        seen.add(msg.fields["uid"])  # type: ignore[index]
        conn.notes["last_uid"] = msg.fields["uid"]  # type: ignore[index]
    elif is_(msg, C.FREE_BUFFER):
        seen.add(-1)
    elif is_(msg, C.GRAPH_RECOMPUTE):
        return on_recompute(conn, msg, seen)
    return None


def _recompute_unknown(conn: Conn, msg: Msg, seen: set[int]) -> Act | None:
    return Act(forward=None) if msg.fields["uid"] not in seen else None  # type: ignore[index]


def _recompute_after_free(conn: Conn, msg: Msg, seen: set[int]) -> Act | None:
    return Act(forward=None) if -1 in seen else None


def _recompute_last(conn: Conn, msg: Msg, seen: set[int]) -> Act | None:
    fields = {**(msg.fields or {}), "uid": conn.notes.get("last_uid", 0)}
    return Act(forward=encode_request(conn.protocol, C.GRAPH_RECOMPUTE, fields))


V8_BREAKERS: dict[str, Callable[[], Breaker]] = {
    "DATA-031": lambda: RewriteRequest(lambda conn, msg: is_(msg, C.SET_TENSOR_2D), _rows_contiguous),
    "DATA-032": lambda: RewriteReply(C.GET_TENSOR_2D, lambda conn, msg, body: body[::-1]),
    "FRAME-041": lambda: AcceptBad(lambda conn, msg: is_(msg, C.SET_TENSOR_2D)
                                   and msg.fields["size"] * msg.fields["n_copies"] != len(msg.data or b"")),
    "FRAME-042": lambda: AcceptBad(lambda conn, msg: is_(msg, C.SET_TENSOR_2D, C.GET_TENSOR_2D)
                                   and 0 in (msg.fields["size"], msg.fields["n_copies"])),
    "FRAME-043": lambda: AcceptBad(lambda conn, msg: is_(msg, C.SET_TENSOR_2D, C.GET_TENSOR_2D)
                                   and rows_outside_tensor(conn, msg)),
    "FRAME-044": lambda: AcceptBad(lambda conn, msg: is_(msg, C.SET_TENSOR_2D, C.GET_TENSOR_2D) and region_2d_span(
        msg.fields["size"], msg.fields["n_copies"], msg.fields["stride"]) is None),
    "FRAME-045": lambda: Stateful(lambda conn, msg: _uids(conn, msg, on_recompute=_recompute_unknown)),
    "FRAME-046": lambda: Stateful(lambda conn, msg: _uids(conn, msg, on_recompute=_recompute_after_free)),
    "FRAME-047": lambda: AcceptBad(lambda conn, msg: msg.command is C.GRAPH_COMPUTE and msg.size < 20),
    "COMPUTE-016": lambda: Stateful(lambda conn, msg: _uids(conn, msg, on_recompute=_recompute_last)),
    "COMM-001": lambda: RewriteReply(C.COMM_INIT, lambda conn, msg, body: b"\x01"),
    "COMM-002": lambda: AcceptBad(lambda conn, msg: is_(msg, C.COMM_ALLREDUCE)),
    "COMM-003": lambda: AcceptBad(lambda conn, msg: is_(msg, C.COMM_ALLREDUCE)),
}
BREAKERS |= V8_BREAKERS


# ---- memory-safety bug classes (FRAME-048..060) ------------------------------------------------------------------


def graph_rows(msg: Msg) -> list[dict[str, Any]]:
    """The tensors of a GRAPH_COMPUTE as dicts (an empty list for any other request)."""
    g = graph_tensors(msg)
    if g is None:
        return []
    tensors = g[1]
    return [{name: (tensors[name][i].tolist()) for name in tensors.dtype.names} for i in range(len(tensors))]


def all_tensors(msg: Msg) -> list[dict[str, Any]]:
    return tensors_of(msg) + graph_rows(msg)


def partial_block(t: dict) -> bool:
    """A quantised tensor whose rows end inside a block (#25288)."""
    return not bad_type(t) and not removed_type(t) and TYPES[t["type"]].blck > 1 and t["ne"][0] % TYPES[t["type"]].blck


def _output(msg: Msg) -> dict[str, Any] | None:
    """The graph's last node (the one the bug-class checks guard with canaries), or where it has no memory (buffer
    0) the first tensor that has."""
    g = graph_tensors(msg)
    if g is None or not g[0]:
        return None
    rows = graph_rows(msg)
    out = next((t for t in rows if t["id"] == g[0][-1]), None)
    if out is None or out["data"] == 0:
        out = next((t for t in rows if t["data"] != 0), None)
    return out


def _remember_fill(conn: Conn, msg: Msg) -> None:
    """Keep the bytes of a SET_TENSOR at each address: what the checks' canaries were filled with."""
    if msg.cmd == C.SET_TENSOR and msg.fields is not None and msg.data:
        start = msg.fields["tensor"]["data"] + msg.fields["offset"]
        conn.notes.setdefault("fills", []).append((start, msg.data))


def _byte_at(conn: Conn, address: int, n: int) -> bytes | None:
    """The last bytes a SET_TENSOR wrote at [address, +n), or None when no single SET_TENSOR covered them."""
    for start, data in reversed(conn.notes.get("fills", [])):
        if start <= address and address + n <= start + len(data):
            return data[address - start : address - start + n]
    return None


def writes_before_output(pred: Callable[[Conn, Msg], bool]) -> Breaker:
    """Graphs matching ``pred`` are not computed: 16 bytes right before their output are overwritten instead (what
    an out-of-bounds kernel write does to the canary there), and the connection goes on."""

    def fn(conn: Conn, msg: Msg) -> Act | None:
        out = _output(msg) if msg.cmd == C.GRAPH_COMPUTE else None
        if out is None or not pred(conn, msg):
            return None
        t = {**out, "type": int(GgmlType.I8), "ne": [16, 1, 1, 1], "nb": [1, 16, 16, 16], "data": out["data"] - 16,
             "op": 0, "src": [0] * 10, "view_src": 0}
        return Act(forward=encode_request(conn.protocol, C.MEMSET_TENSOR,
                                          {"tensor": t, "offset": 0, "size": 16, "value": 0x41}))

    return Stateful(lambda conn, msg: _remember_fill(conn, msg) or fn(conn, msg))


def leaks_into_output(pred: Callable[[Conn, Msg], bool]) -> Breaker:
    """Graphs matching ``pred`` are not computed: their output is filled with the 32 bytes before it (canary bytes
    an out-of-bounds kernel read would bring back), and the connection goes on."""

    def fn(conn: Conn, msg: Msg) -> Act | None:
        out = _output(msg) if msg.cmd == C.GRAPH_COMPUTE else None
        if out is None or not pred(conn, msg):
            return None
        leaked = _byte_at(conn, out["data"] - 32, 32)
        if leaked is None:
            return None
        t = {**out, "type": int(GgmlType.I8), "ne": [32, 1, 1, 1], "nb": [1, 32, 32, 32], "op": 0, "src": [0] * 10,
             "view_src": 0}
        fields = {"tensor": t, "offset": 0}
        if conn.protocol.cache_rule.flag_field:
            fields[conn.protocol.cache_rule.flag_field] = 0
        return Act(forward=encode_request(conn.protocol, C.SET_TENSOR, fields, leaked))

    return Stateful(lambda conn, msg: _remember_fill(conn, msg) or fn(conn, msg))


def graph_has_op(*ops: GgmlOp) -> Callable[[Conn, Msg], bool]:
    wanted = {int(o) for o in ops}
    return lambda conn, msg: any(t["op"] in wanted for t in graph_rows(msg))


def _cyclic(conn: Conn, msg: Msg) -> bool:
    g = graph_tensors(msg)
    if g is None:
        return False
    rows = graph_rows(msg)
    srcs = {t["id"]: set(t["src"]) | {t["view_src"]} for t in rows}
    own = any(t["id"] in srcs[t["id"]] for t in rows)
    pair = any(b in srcs and a in srcs[b] for a, s in srcs.items() for b in s if b and b != a)
    return own or pair or len(set(g[0])) != len(g[0])


def _foreign_buffer(conn: Conn, msg: Msg) -> bool:
    return any(t["buffer"] and t["buffer"] not in conn.buffers for t in graph_rows(msg))


def _wraps(t: dict) -> bool:
    return not bad_type(t) and not removed_type(t) and nbytes(t) > U64


BUG_CLASS_BREAKERS: dict[str, Callable[[], Breaker]] = {
    "FRAME-048": lambda: AcceptBad(lambda conn, msg: any(partial_block(t) for t in all_tensors(msg))),
    "FRAME-049": lambda: writes_before_output(lambda conn, msg: any(0 in t["ne"] for t in graph_rows(msg))),
    "FRAME-050": lambda: AcceptBad(lambda conn, msg: any(_wraps(t) for t in all_tensors(msg))),
    "FRAME-051": lambda: writes_before_output(lambda conn, msg: any(t["view_offs"] >= 1 << 20
                                                                    for t in graph_rows(msg))),
    "FRAME-052": lambda: writes_before_output(lambda conn, msg: any(t["buffer"] == 0 and t["data"] == 0
                                                                    for t in graph_rows(msg))),
    "FRAME-053": lambda: AcceptBad(_foreign_buffer),
    "FRAME-054": lambda: writes_before_output(_cyclic),
    "FRAME-055": lambda: leaks_into_output(graph_has_op(GgmlOp.GET_ROWS)),
    "FRAME-056": lambda: writes_before_output(graph_has_op(GgmlOp.SET_ROWS)),
    "FRAME-057": lambda: writes_before_output(graph_has_op(GgmlOp.ACC, GgmlOp.SET)),
    "FRAME-058": lambda: leaks_into_output(graph_has_op(GgmlOp.SSM_SCAN)),
    "FRAME-059": lambda: writes_before_output(graph_has_op(GgmlOp.GATED_DELTA_NET)),
    "FRAME-060": lambda: AcceptBad(graph_has_op(GgmlOp.CUSTOM, GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2,
                                                GgmlOp.MAP_CUSTOM3)),
}
BREAKERS |= BUG_CLASS_BREAKERS


# ---- shadow memory: a server that writes past the destination of one command and geometry class -----------------

#: Bytes a shadow breaker writes into the neighbouring buffer.
STRAY_BYTES = 16


class WritesPast(Breaker):
    """After a request of ``command`` whose written tensor is of the check's geometry class (or any BUFFER_CLEAR),
    the server also writes STRAY_BYTES bytes at the start of the buffer allocated after that tensor's buffer (before
    it, for the last one). A request the reference refuses (the ``outside`` class) is taken instead of refused, and
    the stray bytes are written all the same."""

    def __init__(self, command: Command, klass: str) -> None:
        self.command, self.klass = command, klass

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        f = msg.fields
        if msg.command is not self.command or f is None:
            return None
        if self.command is C.BUFFER_CLEAR:
            home = f["remote_ptr"]
        else:
            t = written_tensor(self.command, f)
            if t is None or not t["buffer"]:
                return None
            home = t["buffer"]
            size, base = conn.buffers.get(home, (0, 0))
            span = Span(home, base, size) if base else None
            if span is None or not in_class(self.klass, classify(t, span)):
                return None
        order = [h for h, (size, base) in conn.buffers.items() if base and size >= STRAY_BYTES]
        if home not in order or len(order) < 2:
            return None
        i = order.index(home)
        victim = order[i + 1] if i + 1 < len(order) else order[i - 1]
        size, base = conn.buffers[victim]
        stray = make_tensor(id=0x57A7, type=int(GgmlType.I8), ne=(size,), buffer=victim, data=base)
        fields = {"tensor": stray, "offset": 0}
        if conn.protocol.cache_rule.flag_field:
            fields[conn.protocol.cache_rule.flag_field] = 0
        inject = encode_request(conn.protocol, C.SET_TENSOR, fields, b"\xee" * STRAY_BYTES)
        if self.klass == "outside":
            return Act(forward=inject, answer=fake_reply(conn.protocol, msg, 0x01))
        return Act(forward=msg.raw, then_upstream=(inject,))


SHADOW_BREAKERS: dict[str, Callable[[], Breaker]] = {
    c.id: (lambda c=c: WritesPast(c.command, c.klass)) for c in SHADOW_CHECKS
}
BREAKERS |= SHADOW_BREAKERS
