"""Named client sessions, recorded as pcap through the recording proxy (``ggml-rpc pcap record``, :mod:`.recording`).

Each scenario drives the kit's client against a server the way llama.cpp's client would (or, for ``bad-input``,
the way a broken one would) and the proxy writes what went over the wire.  Data is generated from fixed seeds, so
a re-recording differs from the committed fixture only in timestamps, ports and server-assigned values.

Fixture sizes stay small: the hash path is exercised with a 64 KiB weight.  Upstream clients only hash transfers
above 10 MiB; a v7 server caches any flagged payload whatever its size, a v6 server only payloads above 10 MiB, so
on v6 the warm connection of ``model-load`` misses again, which is what a v6 server does for a payload that small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    Command,
    GgmlOp,
    GgmlType,
    Protocol,
    TensorFlag,
    encode_request,
    fnv1a64,
    make_tensor,
)
from ggml_rpc.spec.codec import REQUEST_HEADER

from ..client import ConnectionClosed, RpcClient

F32 = int(GgmlType.F32)
Q8_0 = int(GgmlType.Q8_0)
ALIGN = 32
COMPUTE = int(TensorFlag.COMPUTE)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(seed: int, *shape: int) -> bytes:
    return _rng(seed).standard_normal(shape, dtype=np.float32).tobytes()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Session:
    """What a scenario gets: connections to the server (through the recorder) in the scenario's version."""

    def __init__(self, host: str, port: int, protocol: Protocol, *, hash_weight_bytes: int = 64 * 1024) -> None:
        self.host, self.port, self.protocol = host, port, protocol
        #: Size of the weight that takes the hash path (above 10 MiB: what upstream clients hash).
        self.hash_weight_bytes = hash_weight_bytes
        self.notes: list[str] = []

    def connect(self, *, hello: bool = True) -> RpcClient:
        return RpcClient.connect(self.host, self.port, protocol=self.protocol, hello=hello, timeout=30.0)

    @property
    def v7(self) -> bool:
        return self.protocol.cache_rule.flag_field is not None


@dataclass
class _Buffer:
    handle: int
    base: int
    used: int = 0

    def place(self, nbytes: int) -> int:
        addr = self.base + self.used
        self.used += _align(nbytes)
        return addr


def _alloc(c: RpcClient, size: int) -> _Buffer:
    handle, _ = c.alloc_buffer(0, size)
    return _Buffer(handle, c.buffer_get_base(handle))


def _weight(buf: _Buffer, tid: int, name: str, type_: int, ne: tuple[int, ...], nbytes: int) -> dict:
    return make_tensor(id=tid, type=type_, ne=ne, buffer=buf.handle, data=buf.place(nbytes), name=name)


def _probe(c: RpcClient) -> None:
    """What upstream clients do on their short probing connections."""
    c.device_count()
    c.get_device_memory(0)


def _hash_path(s: Session, c: RpcClient, t: dict, data: bytes) -> bool:
    """The client's hash path: SET_TENSOR_HASH, and on a miss SET_TENSOR (v7: with cache_flag = 1)."""
    if c.set_tensor_hash(t, 0, fnv1a64(data)):
        return True
    c.set_tensor(t, 0, data, cache_flag=1 if s.v7 else 0)
    return False


# ---- model-load -------------------------------------------------------------------------------------------------

def model_load(s: Session) -> None:
    rows = max(1, s.hash_weight_bytes // (256 * 4))
    output_weight = (256, rows)  # F32 [256, rows]: the weight that takes the hash path
    with s.connect() as c:
        _probe(c)
    out_data = _f32(7, rows, 256)
    with s.connect() as c:
        c.device_count()
        c.get_alignment(0)
        c.get_max_size(0)
        c.get_device_memory(0)
        buf = _alloc(c, 192 * 1024 + _align(len(out_data)))
        tok = _weight(buf, 0x100, "token_embd.weight", F32, (64, 32), 64 * 32 * 4)
        norm = _weight(buf, 0x101, "blk.0.attn_norm.weight", F32, (64,), 64 * 4)
        q_rows, q_cols = 8, 96  # Q8_0 with ne[0] % 512 != 0: the client asks alloc size and inits it
        q_bytes = q_rows * (q_cols // 32) * 34
        ffn = _weight(buf, 0x102, "blk.0.ffn_down.weight", Q8_0, (q_cols, q_rows), q_bytes)
        c.get_alloc_size(0, ffn)
        c.init_tensor(ffn)
        out = _weight(buf, 0x103, "output.weight", F32, output_weight, len(out_data))
        c.buffer_clear(buf.handle, 0)
        c.set_tensor(tok, 0, _f32(1, 32, 64))
        c.set_tensor(norm, 0, np.ones(64, np.float32).tobytes())
        c.set_tensor(ffn, 0, _rng(3).integers(0, 256, q_bytes, dtype=np.uint8).tobytes())
        hit = _hash_path(s, c, out, out_data)
        s.notes.append(f"cold connection: output.weight hash {'hit' if hit else 'miss'}")
        c.get_tensor(norm, 0, 64 * 4)
        c.get_tensor(out, 0, 4096)
        c.free_buffer(buf.handle)
    with s.connect() as c:
        buf = _alloc(c, _align(len(out_data)))
        out = _weight(buf, 0x203, "output.weight", F32, output_weight, len(out_data))
        hit = _hash_path(s, c, out, out_data)
        s.notes.append(f"warm connection: output.weight hash {'hit' if hit else 'miss'}")
        c.get_tensor(out, 0, len(out_data))
        c.free_buffer(buf.handle)


# ---- inference --------------------------------------------------------------------------------------------------


def _graph(w: dict, b: dict, x: dict, mm: dict, y: dict) -> tuple[list[int], list[dict]]:
    return [mm["id"], y["id"]], [w, x, mm, b, y]


def inference(s: Session) -> None:
    k, n, m = 64, 32, 4
    with s.connect() as c:
        c.device_count()
        c.get_alignment(0)
        wbuf = _alloc(c, 64 * 1024)
        cbuf = _alloc(c, 16 * 1024)
        w = _weight(wbuf, 0x10, "w", F32, (k, n), k * n * 4)
        b = _weight(wbuf, 0x11, "b", F32, (n, m), n * m * 4)
        x = make_tensor(id=0x20, type=F32, ne=(k, m), buffer=cbuf.handle, data=cbuf.place(k * m * 4), name="x",
                        flags=int(TensorFlag.INPUT))
        mm = make_tensor(id=0x21, type=F32, ne=(n, m), buffer=cbuf.handle, data=cbuf.place(n * m * 4), name="wx",
                         op=int(GgmlOp.MUL_MAT), src=[w["id"], x["id"]], flags=COMPUTE, use_count=1)
        y = make_tensor(id=0x22, type=F32, ne=(n, m), buffer=cbuf.handle, data=cbuf.place(n * m * 4), name="y",
                        op=int(GgmlOp.ADD), src=[mm["id"], b["id"]], flags=COMPUTE | int(TensorFlag.OUTPUT))
        c.set_tensor(w, 0, _f32(11, n, k))
        c.set_tensor(b, 0, _f32(12, m, n))
        c.set_tensor(x, 0, _f32(13, m, k))
        nodes, tensors = _graph(w, b, x, mm, y)
        c.graph_compute(0, nodes, tensors)
        c.get_tensor(y, 0, n * m * 4)
        c.set_tensor(x, 0, _f32(14, m, k))  # next token: same graph, new input
        c.graph_recompute(0)
        c.get_tensor(y, 0, n * m * 4)
        c.get_tensor(y, 4 * n, 4 * n)  # one row, at an offset
        keep = make_tensor(id=0x23, type=F32, ne=(n, m), buffer=cbuf.handle, data=cbuf.place(n * m * 4),
                           name="y_copy")
        c.copy_tensor(y, keep)
        c.get_tensor(keep, 0, n * m * 4)
        c.memset_tensor(keep, 0, n * 4, 0)
        c.get_tensor(keep, 0, n * m * 4)
        c.free_buffer(cbuf.handle)
        c.free_buffer(wbuf.handle)


# ---- rows-and-uids (8.0.0) -----------------------------------------------------------------------------------------


def rows_and_uids(s: Session) -> None:
    """8.0.0's new paths as a tensor-split client uses them: a weight written as rows (SET_TENSOR_2D), two graphs
    kept under their uids and recomputed by uid, the output read as rows (GET_TENSOR_2D)."""
    k, n, m = 64, 32, 4
    with s.connect() as c:
        c.device_count()
        wbuf = _alloc(c, 64 * 1024)
        cbuf = _alloc(c, 16 * 1024)
        w = _weight(wbuf, 0x10, "w", F32, (k, n), k * n * 4)
        half = k * 4 // 2  # this rank's half of each row of w, as split by rows of the full matrix
        rows = _f32(31, n, k // 2)
        c.set_tensor(w, 0, bytes(k * n * 4))
        c.set_tensor_2d(w, 0, half, k * 4, rows)
        x = make_tensor(id=0x20, type=F32, ne=(k, m), buffer=cbuf.handle, data=cbuf.place(k * m * 4), name="x",
                        flags=int(TensorFlag.INPUT))
        mm = make_tensor(id=0x21, type=F32, ne=(n, m), buffer=cbuf.handle, data=cbuf.place(n * m * 4), name="wx",
                         op=int(GgmlOp.MUL_MAT), src=[w["id"], x["id"]], flags=COMPUTE | int(TensorFlag.OUTPUT))
        sq = make_tensor(id=0x22, type=F32, ne=(k, m), buffer=cbuf.handle, data=cbuf.place(k * m * 4), name="xx",
                         op=int(GgmlOp.MUL), src=[x["id"], x["id"]], flags=COMPUTE | int(TensorFlag.OUTPUT))
        c.set_tensor(x, 0, _f32(32, m, k))
        c.graph_compute(0, [mm["id"]], [w, x, mm], uid=1)
        c.graph_compute(0, [sq["id"]], [x, sq], uid=2)
        c.get_tensor_2d(mm, 0, n * 4 // 2, m, n * 4)  # the first half of every output row
        c.set_tensor(x, 0, _f32(33, m, k))  # next token
        c.graph_recompute(0, uid=1)
        c.graph_recompute(0, uid=2)
        c.get_tensor(mm, 0, n * m * 4)
        c.get_tensor_2d(sq, 4, 8, m, k * 4)
        c.free_buffer(cbuf.handle)
        c.free_buffer(wbuf.handle)


# ---- cache-flags ------------------------------------------------------------------------------------------------


def cache_flags(s: Session) -> None:
    """v7: only flagged payloads are cached, at any size; v6: nothing this small is cached, flag or not."""
    flagged = _f32(21, 4096)
    plain = _f32(22, 4096)
    with s.connect() as c:
        buf = _alloc(c, 64 * 1024)
        t1 = _weight(buf, 0x31, "flagged", F32, (4096,), len(flagged))
        t2 = _weight(buf, 0x32, "plain", F32, (4096,), len(plain))
        _hash_path(s, c, t1, flagged)  # miss, then SET_TENSOR with the flag (v7)
        c.set_tensor(t2, 0, plain)  # never flagged: not a hash-path transfer
        c.free_buffer(buf.handle)
    with s.connect() as c:
        buf = _alloc(c, 64 * 1024)
        t1 = _weight(buf, 0x41, "flagged", F32, (4096,), len(flagged))
        t2 = _weight(buf, 0x42, "plain", F32, (4096,), len(plain))
        hit1 = c.set_tensor_hash(t1, 0, fnv1a64(flagged))  # v7: hit; v6: miss (not above 10 MiB)
        hit2 = c.set_tensor_hash(t2, 0, fnv1a64(plain))  # miss in both
        s.notes.append(f"flagged payload: {'hit' if hit1 else 'miss'}; unflagged payload: "
                       f"{'hit' if hit2 else 'miss'}")
        if not hit1:
            c.set_tensor(t1, 0, flagged, cache_flag=1 if s.v7 else 0)
        if not hit2:
            c.set_tensor(t2, 0, plain, cache_flag=1 if s.v7 else 0)
        c.get_tensor(t1, 0, len(flagged))
        c.free_buffer(buf.handle)


# ---- bad-input --------------------------------------------------------------------------------------------------


def _expect_close(s: Session, c: RpcClient, what: str) -> None:
    """After a request the server must refuse: probe with DEVICE_COUNT (it has a reply) and wait for the close."""
    try:
        c.send_raw(encode_request(s.protocol, Command.DEVICE_COUNT, {}))
    except ConnectionClosed:
        pass
    closed = c.expect_closed(5.0)
    s.notes.append(f"{what}: {'closed' if closed else 'NOT closed'}")


def _raw(c: RpcClient, cmd: int, payload: bytes, size: int | None = None) -> None:
    try:
        c.send_raw(REQUEST_HEADER.pack(cmd, len(payload) if size is None else size) + payload)
    except ConnectionClosed:
        pass


def bad_input(s: Session) -> None:
    """One connection per validation rule (spec/PROTOCOL.md#rules), each ending with the server closing."""
    cases: list[tuple[str, Callable[[RpcClient], None], bool]] = []

    def case(what: str, hello: bool = True):
        def deco(fn: Callable[[RpcClient], None]) -> Callable[[RpcClient], None]:
            cases.append((what, fn, hello))
            return fn
        return deco

    @case("first command is not HELLO", hello=False)
    def _(c: RpcClient) -> None:
        _raw(c, int(Command.DEVICE_COUNT), b"")

    @case("HELLO of the wrong size", hello=False)
    def _(c: RpcClient) -> None:
        _raw(c, int(Command.HELLO), bytes(CONN_CAPS_SIZE + 4))

    @case("second HELLO")
    def _(c: RpcClient) -> None:
        _raw(c, int(Command.HELLO), bytes(CONN_CAPS_SIZE))

    @case(f"command {s.protocol.sentinel} (NONE, never on the wire)")
    def _(c: RpcClient) -> None:
        _raw(c, s.protocol.sentinel, b"")

    @case("fixed-size request of the wrong size")
    def _(c: RpcClient) -> None:
        _raw(c, int(Command.GET_ALIGNMENT), bytes(5))

    @case("device index out of range")
    def _(c: RpcClient) -> None:
        c.send_raw(encode_request(s.protocol, Command.GET_ALIGNMENT, {"device": 7}))

    @case("unknown buffer handle")
    def _(c: RpcClient) -> None:
        c.send_raw(encode_request(s.protocol, Command.BUFFER_GET_BASE, {"remote_ptr": 0xDEAD}))

    @case("SET_TENSOR to a tensor without a buffer")
    def _(c: RpcClient) -> None:
        c.set_tensor(make_tensor(id=1, ne=(4,), name="nobuf"), 0, bytes(16))

    @case("SET_TENSOR past the end of its buffer")
    def _(c: RpcClient) -> None:
        buf = _alloc(c, 64)
        c.set_tensor(make_tensor(id=1, ne=(16,), buffer=buf.handle, data=buf.base + 32, name="outside"), 0,
                     bytes(64))

    @case("tensor type out of range")
    def _(c: RpcClient) -> None:
        t = make_tensor(id=1, ne=(4,), name="badtype")
        t["type"] = 200
        fields = {"tensor": t}
        c.send_raw(encode_request(s.protocol, Command.INIT_TENSOR, fields))

    @case("GRAPH_RECOMPUTE without a stored graph")
    def _(c: RpcClient) -> None:
        c.graph_recompute(0)

    @case("GRAPH_COMPUTE node not among the tensors")
    def _(c: RpcClient) -> None:
        buf = _alloc(c, 1024)
        t = make_tensor(id=5, ne=(4,), buffer=buf.handle, data=buf.base, name="t", flags=COMPUTE)
        c.graph_compute(0, [99], [t])

    for what, fn, hello in cases:
        with s.connect(hello=hello) as c:
            fn(c)
            _expect_close(s, c, what)


# ---- cache-flag-abuse -------------------------------------------------------------------------------------------


def cache_flag_abuse(s: Session) -> None:
    """A client breaking the v7 cache-flag rule (what ``ggml-rpc lint`` must find): a flag without a miss, a flag
    after a miss for other data, and no flag after a miss."""
    a, b, d = _f32(31, 1024), _f32(32, 1024), _f32(33, 1024)
    with s.connect() as c:
        buf = _alloc(c, 16 * 1024)
        t = _weight(buf, 0x51, "abused", F32, (1024,), len(a))
        c.set_tensor(t, 0, a, cache_flag=1)  # no SET_TENSOR_HASH before it
        c.set_tensor_hash(t, 0, fnv1a64(a) ^ 1)  # a miss for a hash nobody has
        c.set_tensor(t, 0, b, cache_flag=1)  # flagged, but b is not what missed
        c.set_tensor_hash(t, 0, fnv1a64(d))  # a genuine miss ...
        c.set_tensor(t, 0, d, cache_flag=0)  # ... followed by its data without the flag
        c.get_tensor(t, 0, 64)
        c.free_buffer(buf.handle)


# ---- registry and recording -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Session], None]
    exercises: str
    majors: tuple[int, ...] = (6, 7, 8)
    #: Whether ``ggml-rpc lint`` finds nothing in the recording.
    lint_clean: bool = True


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("model-load", model_load, "probe connection; llama-style weight buffer: alignment, max size, memory, "
             "alloc, base, GET_ALLOC_SIZE and INIT_TENSOR of a Q8_0 tensor, BUFFER_CLEAR, SET_TENSOR of weights, "
             "the hash path cold (miss, SET_TENSOR, v7 cache_flag=1) then warm on a new connection, reads back"),
    Scenario("inference", inference, "F32 MUL_MAT + ADD graph: GRAPH_COMPUTE, GET_TENSOR of the output, new input "
             "and GRAPH_RECOMPUTE, offset read, COPY_TENSOR, MEMSET_TENSOR, FREE_BUFFER"),
    Scenario("cache-flags", cache_flags, "server cache rule: a flagged and an unflagged payload, then "
             "SET_TENSOR_HASH of both on a new connection (v7: flagged hit, unflagged miss; v6: both miss below "
             "10 MiB)"),
    Scenario("bad-input", bad_input, "one connection per validation rule: no HELLO first, HELLO size, second HELLO, "
             "command 18, wrong fixed size, device out of range, unknown handle, SET_TENSOR without buffer / past "
             "its buffer, bad type, RECOMPUTE without graph, unknown graph node; each ends with the server closing",
             lint_clean=False),
    Scenario("cache-flag-abuse", cache_flag_abuse, "a client breaking the v7 cache-flag rule three ways (lint "
             "must flag them)", majors=(7, 8), lint_clean=False),
    Scenario("rows-and-uids", rows_and_uids, "8.0.0: a weight written as rows (SET_TENSOR_2D), two graphs kept "
             "under their uids and recomputed by uid, outputs read as rows (GET_TENSOR_2D)", majors=(8,)),
)}


__all__ = ["SCENARIOS", "Scenario", "Session"]
