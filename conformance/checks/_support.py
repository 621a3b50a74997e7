"""What check functions share: the registry decorator, buffer/tensor builders, graphs built in a server buffer and
mirrored locally for the reference executor, and the close/no-reply probes."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import (
    Blocked,
    Category,
    Check,
    CheckFailed,
    Context,
    Level,
    Unsupported,
    hexdump,
)
from ggml_rpc.conformance.nmse import nmse
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.graph import ExecutorError, build_graph
from ggml_rpc.spec import V6, Command, GgmlOp, GgmlType, TensorFlag, make_tensor, tensor_nbytes, tensors_array
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER

#: Every check in definition order; the catalogue module freezes it.
REGISTRY: list[Check] = []

#: Every major the kit covers: a check applies to all of them unless it says otherwise.
BOTH = (6, 7, 8)
I8 = int(GgmlType.I8)
F32 = int(GgmlType.F32)
F16, I32 = int(GgmlType.F16), int(GgmlType.I32)
_DTYPES = {F32: np.dtype("<f4"), F16: np.dtype("<f2"), I32: np.dtype("<i4")}
_ALIGN = 64


#: Categories whose every check sends input the spec does not allow (see :attr:`~..harness.model.Check.bad_input`).
BAD_INPUT_CATEGORIES = frozenset({Category.FRAMING, Category.ISOLATION})


def check(
    id: str,
    title: str,
    category: Category,
    *,
    level: Level = Level.MUST,
    majors: tuple[int, ...] = BOTH,
    section: Command | str,
    min_version: tuple[int, int, int] | None = None,
    max_version: tuple[int, int, int] | None = None,
    any_version: bool = False,
    rules: tuple[str, ...] = (),
    bad_input: bool | None = None,
) -> Callable[[Callable[[Context], str | None]], Callable[[Context], str | None]]:
    """Declare a check: the decorated function becomes the check's body.  ``rules``: the ids of the rule table's
    rules it enforces (see :attr:`~ggml_rpc.conformance.harness.Check.rules`).  ``bad_input`` (what the check sends
    is not allowed by the spec) defaults to the category's nature: framing checks send malformed or out-of-range
    requests, isolation checks another connection's handles; the other categories say it per check."""
    if bad_input is None:
        bad_input = category in BAD_INPUT_CATEGORIES

    def deco(func: Callable[[Context], str | None]) -> Callable[[Context], str | None]:
        if any(c.id == id for c in REGISTRY):
            raise ValueError(f"duplicate check id {id}")
        body = _declined_only_if_computing(func) if category is Category.COMPUTE else func
        REGISTRY.append(
            Check(id, title, category, level, majors, section, body, min_version, max_version, any_version, rules,
                  bad_input)
        )
        return func

    return deco


def _declined_only_if_computing(func: Callable[[Context], str | None]) -> Callable[[Context], str | None]:
    """A compute check whose op the server declines is "unsupported" only when the server computes something:
    a server that closes on every GRAPH_COMPUTE has no compute at all, which fails the check (a server must
    compute graphs; declining one op family is allowed, declining them all is not)."""

    def body(ctx: Context) -> str | None:
        try:
            return func(ctx)
        except Unsupported as exc:
            why = ctx.shared("no-compute", lambda: _no_compute(ctx))
            if why is None:
                raise
            raise fail(f"the server computes no graph at all: {why}; {exc}", expected="a computed ADD",
                       got=why) from None

    body.__name__ = func.__name__
    body.__doc__ = func.__doc__
    return body


def _no_compute(ctx: Context) -> str | None:
    """Why the server computes nothing (it closes on the smallest graph, ADD of two f32 tensors), or None."""
    g = GraphBuilder(ctx, 4096)
    a = g.input(F32, (4,), np.arange(4, dtype=np.float32))
    out = g.op(GgmlOp.ADD, [a, a], (4,))
    try:
        g.client.graph_compute(0, g.nodes, g.tensors)
        g.client.get_tensor(out, 0, 16)
    except (ConnectionClosed, OSError):
        ctx.note("probe: GRAPH_COMPUTE of ADD of two 4-element f32 tensors", expected="a computed result",
                 got="connection closed")
        return "it closed the connection even on ADD of two 4-element f32 tensors"
    return None


def fail(message: str, *, sent: str | None = None, expected: str | None = None, got: str | None = None,
         level: Level | None = None) -> CheckFailed:
    return CheckFailed(message, sent=sent, expected=expected, got=got, level=level)


def nonce(n: int) -> bytes:
    """Unique bytes: payloads differ on every run, so a cache filled by an earlier run never answers for this one."""
    return os.urandom(n)


# ---- buffers and tensors ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Buf:
    """A server buffer allocated for a check."""

    client: RpcClient
    handle: int
    base: int
    size: int

    def tensor(self, offset: int, n: int, *, id: int = 0x1000, type: int = I8, data: int | None = None,
               buffer: int | None = None) -> dict:
        """A 1-D tensor of ``n`` bytes (I8 elements) at ``base + offset`` of this buffer (``buffer``: another
        handle, e.g. 0 or a made-up one, for the bad-handle checks)."""
        return make_tensor(id=id or 0x1000, type=type, ne=(n,), buffer=self.handle if buffer is None else buffer,
                           data=self.base + offset if data is None else data)

    def f32(self, offset: int, ne: tuple[int, ...], *, id: int) -> dict:
        return make_tensor(id=id, type=F32, ne=ne, buffer=self.handle, data=self.base + offset)


def alloc(client: RpcClient, size: int, device: int = 0) -> Buf:
    """ALLOC_BUFFER + BUFFER_GET_BASE; :class:`Blocked` if the server cannot give ``size`` bytes."""
    handle, got = client.alloc_buffer(device, size)
    if handle == 0 or got < size:
        # Blocked, not failed: a check that needs this buffer cannot test its rule (DATA-001 judges ALLOC_BUFFER).
        raise Blocked(f"ALLOC_BUFFER of {size} bytes was refused", expected=f"handle != 0, remote_size >= {size}",
                      got=f"handle {handle:#x}, remote_size {got}",
                      cause="ALLOC_BUFFER refused the buffers the checks write into (256 bytes to 1 MiB)")
    base = client.buffer_get_base(handle)
    return Buf(client, handle, base, got)


def session(ctx: Context, size: int = 4096) -> Buf:
    """A fresh connection with one buffer of ``size`` bytes."""
    return alloc(ctx.connect(), size)


def read_back(buf: Buf, offset: int, n: int) -> bytes:
    return bytes(buf.client.get_tensor(buf.tensor(0, buf.size), offset, n)) if n else b""


def expect_bytes(step: str, got: bytes, want: bytes) -> None:
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        lo = max(0, first - 8)
        raise fail(f"{step}: data differs from byte {first}", expected=hexdump(want[lo:lo + 32], 32),
                   got=hexdump(got[lo:lo + 32], 32))


# ---- graphs -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Mirror:
    """The local copy of the server buffer the reference executor runs on (same handle and base)."""

    base: int
    size: int
    memory: np.ndarray


class GraphBuilder:
    """Builds a graph inside one server buffer while mirroring every byte locally."""

    def __init__(self, ctx: Context, size: int = 1 << 16) -> None:
        self.ctx = ctx
        self.client = ctx.connect()
        self.buf = alloc(self.client, size)
        self.mirror = _Mirror(self.buf.base, self.buf.size, np.zeros(self.buf.size, dtype=np.uint8))
        self.tensors: list[dict] = []
        self.nodes: list[int] = []
        self._offset = 0
        self._id = 0x10
        self.ops: list[str] = []

    def _place(self, type_id: int, ne: Sequence[int], **fields: object) -> dict:
        """A new tensor with its own aligned room in the buffer; ``fields`` go to ``make_tensor`` (which pads
        ``src`` and ``op_params`` to their fixed counts)."""
        self._id += 1
        off = -(-self._offset // _ALIGN) * _ALIGN
        t = make_tensor(id=self._id, type=type_id, ne=tuple(ne), buffer=self.buf.handle, data=self.buf.base + off,
                        **fields)
        n = tensor_nbytes(t)
        if off + n > self.buf.size:
            raise ValueError("graph does not fit its buffer")
        self._offset = off + n
        return t

    def input(self, type_id: int, ne: Sequence[int], values: np.ndarray | bytes) -> dict:
        """A leaf tensor holding ``values`` (numbers, or raw bytes for block-quantised types)."""
        t = self._place(type_id, ne)
        raw = values if isinstance(values, bytes) else np.ascontiguousarray(values, dtype=_DTYPES[type_id]).tobytes()
        if len(raw) != tensor_nbytes(t):
            raise ValueError(f"{len(raw)} bytes for a {tensor_nbytes(t)}-byte tensor")
        off = t["data"] - self.buf.base
        self.mirror.memory[off : off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.client.set_tensor(t, 0, raw)
        self.tensors.append(t)
        return t

    def op(self, op: GgmlOp, srcs: Sequence[dict], ne: Sequence[int], *, type_id: int = F32,
           params: Sequence[int] = ()) -> dict:
        t = self._place(type_id, ne, op=int(op), src=[s["id"] for s in srcs], flags=int(TensorFlag.COMPUTE),
                        op_params=list(params))
        self.tensors.append(t)
        self.nodes.append(t["id"])
        self.ops.append(op.name)
        return t

    def cpy(self, a: dict, type_id: int) -> dict:
        """CPY of ``a`` into a new destination of ``type_id``: as ggml builds it, the node is a view of the
        destination (op CPY, sources a and the destination)."""
        dst = self._place(type_id, tuple(a["ne"]))
        self.tensors.append(dst)
        self._id += 1
        node = make_tensor(id=self._id, type=type_id, ne=tuple(dst["ne"]), nb=tuple(dst["nb"]), buffer=dst["buffer"],
                           data=dst["data"], op=int(GgmlOp.CPY), src=[a["id"], dst["id"]], view_src=dst["id"],
                           flags=int(TensorFlag.COMPUTE))
        self.tensors.append(node)
        self.nodes.append(node["id"])
        self.ops.append("CPY")
        return node

    def view(self, op: GgmlOp, of: dict, ne: Sequence[int], nb: Sequence[int]) -> dict:
        """A node that only re-describes ``of``'s memory (TRANSPOSE, PERMUTE, VIEW, RESHAPE)."""
        self._id += 1
        t = make_tensor(id=self._id, type=of["type"], ne=tuple(ne), nb=tuple(nb), buffer=of["buffer"],
                        data=of["data"], op=int(op), src=[of["id"]], view_src=of["id"])
        self.tensors.append(t)
        self.nodes.append(t["id"])
        return t

    def compare(self, outputs: Sequence[dict], limit: float, what: str) -> str:
        """Compute on the server and locally; every output must agree within ``limit`` NMSE."""
        ops = ", ".join(dict.fromkeys(self.ops))
        try:
            self.client.graph_compute(0, self.nodes, self.tensors)
            got = [bytes(self.client.get_tensor(t, 0, tensor_nbytes(t))) for t in outputs]
        except ConnectionClosed:
            raise Unsupported(f"the server closed the connection on a GRAPH_COMPUTE of {ops} (op declined)") from None
        return self._judge(outputs, got, limit, what)

    def reference(self) -> None:
        graph = build_graph(np.asarray(self.nodes, dtype=np.uint64), tensors_array(self.tensors),
                            {self.buf.handle: self.mirror})
        execute(graph.nodes)

    def local(self, t: dict) -> np.ndarray:
        off = t["data"] - self.buf.base
        return self.mirror.memory[off : off + tensor_nbytes(t)].view(_DTYPES[t["type"]])

    def _judge(self, outputs: Sequence[dict], got: Sequence[bytes], limit: float, what: str) -> str:
        try:
            self.reference()
        except ExecutorError as exc:  # the kit's own executor refusing its own graph is a kit bug
            raise RuntimeError(f"reference executor refused the check's graph: {exc}") from exc
        worst = 0.0
        for t, raw in zip(outputs, got, strict=True):
            want = self.local(t)
            have = np.frombuffer(raw, dtype=_DTYPES[t["type"]])
            err = nmse(want, have)
            worst = max(worst, err)
            if not err <= limit:
                name = GgmlOp(t["op"]).name
                raise fail(f"{what}: {name} output differs from the reference executor (NMSE {err:.3g} > {limit:g})",
                           expected=np.array2string(want[:8], precision=5), got=np.array2string(have[:8], precision=5))
        return f"worst NMSE {worst:.2g} (limit {limit:g})"


# ---- raw requests and probes ------------------------------------------------------------------------------------


def raw_request(command: int, payload: bytes, size: int | None = None) -> bytes:
    """A request whose size header may lie (``size``) about its payload."""
    return REQUEST_HEADER.pack(command, len(payload) if size is None else size) + payload


#: DEVICE_COUNT: the probe sent after a request that should have closed the connection.  A server that wrongly
#: kept the connection open answers it at once, so the check does not have to wait for a timeout.
PROBE = raw_request(Command.DEVICE_COUNT, b"")
#: The probe's reply body size (DEVICE_COUNT is the same in every version).
PROBE_REPLY_SIZE = V6.spec(Command.DEVICE_COUNT).reply.header_size


#: A peer that keeps talking is cut off after this much evidence.
DRAIN_LIMIT = 64 << 10


def _drain(sock: socket.socket, first_timeout: float) -> tuple[bytes, bool]:
    """Read until EOF/reset (closed=True) or until the peer falls silent or has said enough (closed=False)."""
    got = bytearray()
    sock.settimeout(first_timeout)
    while len(got) < DRAIN_LIMIT:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return bytes(got), True
        except TimeoutError:
            return bytes(got), False
        except OSError:
            return bytes(got), True
        if not chunk:
            return bytes(got), True
        got += chunk
        sock.settimeout(0.2)  # the peer answered: collect what follows, briefly
    return bytes(got), False


def expect_close(ctx: Context, client: RpcClient, sent: bytes, step: str, *, probe: bool = True) -> None:
    """The request ``sent`` (already sent) must make the server close without a single reply byte."""
    if probe:
        try:
            client.send_raw(PROBE)
        except ConnectionClosed:
            pass
        except OSError:
            pass
    got, closed = _drain(client.sock, ctx.timeout)
    sent_hex = hexdump(sent, 48)
    if got:
        raise fail(f"{step}: the server answered instead of closing", sent=sent_hex,
                   expected="connection closed, no reply bytes", got=hexdump(got) + ("" if closed else " (still open)"))
    if not closed:
        raise fail(f"{step}: the connection stayed open (no close within {ctx.timeout:g} s)", sent=sent_hex,
                   expected="connection closed, no reply bytes", got="connection open, silent")
    ctx.note(step, sent=sent_hex, expected="close", got="closed, no reply bytes")


def send_and_expect_close(ctx: Context, client: RpcClient, sent: bytes, step: str) -> None:
    try:
        client.send_raw(sent)
    except ConnectionClosed:
        pass
    expect_close(ctx, client, sent, step)


def bad_on_fresh(ctx: Context, build: Callable[[Buf], bytes], step: str, size: int = 4096) -> None:
    """New connection and buffer, then the bad request ``build(buf)`` must close the connection."""
    buf = session(ctx, size)
    send_and_expect_close(ctx, buf.client, build(buf), step)


def expect_open(ctx: Context, client: RpcClient, sent: bytes, step: str) -> None:
    """After ``sent``, the connection must still answer the next command, and nothing else may arrive first."""
    try:
        client.send_raw(PROBE)
        header = bytearray(8)
        client._recv_into(memoryview(header))
    except ConnectionClosed as exc:
        raise fail(f"{step}: the server closed the connection", sent=hexdump(sent, 48),
                   expected="connection open", got=str(exc)) from None
    (size,) = REPLY_HEADER.unpack(header)
    if size != PROBE_REPLY_SIZE:
        raise fail(f"{step}: unexpected bytes before the next reply", sent=hexdump(sent, 48),
                   expected="DEVICE_COUNT reply header " + hexdump(REPLY_HEADER.pack(PROBE_REPLY_SIZE)),
                   got=hexdump(header))
    body = bytearray(PROBE_REPLY_SIZE)
    client._recv_into(memoryview(body))


def recv_upto(sock: socket.socket, n: int, timeout: float) -> bytes:
    """Up to ``n`` bytes: fewer only if the peer closes or falls silent for ``timeout``."""
    got = bytearray()
    sock.settimeout(timeout)
    while len(got) < n:
        try:
            chunk = sock.recv(n - len(got))
        except (TimeoutError, OSError):
            break
        if not chunk:
            break
        got += chunk
    return bytes(got)


def expect_silence_then_reply(ctx: Context, client: RpcClient, sent: bytes, what: str) -> None:
    """A no-reply command ``sent`` must produce no bytes: the next reply-bearing command's reply comes first."""
    client.send_raw(PROBE)
    want = REPLY_HEADER.pack(PROBE_REPLY_SIZE)
    got = recv_upto(client.sock, len(want) + PROBE_REPLY_SIZE, ctx.timeout)
    if len(got) != len(want) + PROBE_REPLY_SIZE or got[: len(want)] != want:
        raise fail(f"{what} has no reply, but other bytes arrived where the next command's reply belongs",
                   sent=hexdump(sent, 48),
                   expected=f"only the DEVICE_COUNT reply: {hexdump(want)} + {PROBE_REPLY_SIZE} bytes",
                   got=hexdump(got))
    client.sock.settimeout(ctx.timeout)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)
