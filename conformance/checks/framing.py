"""Framing and bad input: one check per validation rule of the protocol (protocol.md §6).

MUST: the server closes where the rule says so, and no reply ever carries bytes (least of all bytes from outside a
buffer).  SHOULD (checked by the runner after each of these): the server still accepts a new connection — upstream
6.0/7.0 builds die on several of these inputs (assertion or crash), which is reported as a SHOULD failure.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
from ggml_rpc.conformance.checks._support import (
    PROBE,
    PROBE_REPLY_SIZE,
    Buf,
    bad_on_fresh,
    expect_close,
    expect_open,
    fail,
    raw_request,
    recv_upto,
    send_and_expect_close,
    session,
    u64,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import Category, Context, Level, hexdump
from ggml_rpc.spec import V6, V7, V7_0_1, GgmlOp, GgmlType, TensorFlag, encode_request, make_tensor, null_tensor
from ggml_rpc.spec import Command as C
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER_SIZE, TENSOR_DTYPE, TENSOR_LAYOUT
from ggml_rpc.spec.tensor import GGML_MAX_SRC

FR = Category.FRAMING


def _srcs() -> list[dict]:
    return [null_tensor() for _ in range(GGML_MAX_SRC)]


def add_graph(buf: Buf, *, device: int = 0, base_id: int = 0x100) -> tuple[list[int], list[dict]]:
    """A valid 3-tensor graph (c = a + b, four f32 each) living in ``buf``: node ids and tensors."""
    a = buf.f32(0, (4,), id=base_id + 1)
    b = buf.f32(16, (4,), id=base_id + 2)
    c = buf.f32(32, (4,), id=base_id + 3)
    c.update(op=int(GgmlOp.ADD), src=[a["id"], b["id"]] + [0] * (GGML_MAX_SRC - 2), flags=int(TensorFlag.COMPUTE))
    return [c["id"]], [a, b, c]


def graph_bytes(device: int, nodes: list[int], tensors: list[dict]) -> bytes:
    """A GRAPH_COMPUTE request (laid out the same in every covered version)."""
    return encode_request(V6, C.GRAPH_COMPUTE, {"device": device, "nodes": nodes, "tensors": tensors})


@_check("FRAME-001", "a command id at or above RPC_CMD_COUNT closes the connection", FR, section="enum-commands")
def unknown_command(ctx: Context) -> None:
    for cmd in (ctx.protocol.command_count, 200, 255):
        client = ctx.connect()
        send_and_expect_close(ctx, client, raw_request(cmd, b""), f"command {cmd}")
        client.close()


@_check("FRAME-002", "command 18 (NONE, a client-side sentinel) closes the connection", FR, section="enum-commands")
def none_command(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.NONE, b""), "command 18 (NONE)")


@_check("FRAME-003", "GET_DEVICE_SUPPORTS_OP (19) closes the connection on servers before 7.0.1", FR,
        section="enum-commands", max_version=(7, 0, 0))
def supports_op_before_701(ctx: Context) -> None:
    # encoded with the 7.0.1 table, the first to have the command
    sent = encode_request(V7_0_1, C.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": null_tensor(), "srcs": _srcs()})
    send_and_expect_close(ctx, ctx.connect(), sent, "command 19 on a server without it")


@_check("FRAME-004", "a fixed-size request with the wrong size closes the connection (payload unread)", FR,
        section="framing")
def wrong_fixed_size(ctx: Context) -> None:
    # (command, bytes more or fewer than the size the spec table fixes for it)
    cases = [
        (C.GET_ALIGNMENT, +1),
        (C.ALLOC_BUFFER, +4),
        (C.BUFFER_GET_BASE, -4),
        (C.GET_TENSOR, -1),
        (C.COPY_TENSOR, +8),
        (C.GET_DEVICE_MEMORY, -4),
    ]
    for cmd, delta in cases:
        size = ctx.protocol.spec(cmd).request.header_size + delta
        client = ctx.connect()
        send_and_expect_close(ctx, client, raw_request(cmd, bytes(size)), f"{cmd.name} with size {size}")
        client.close()


@_check("FRAME-005", "DEVICE_COUNT with a non-empty payload closes the connection", FR, section=C.DEVICE_COUNT)
def device_count_size(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.DEVICE_COUNT, bytes(4)), "DEVICE_COUNT with size 4")


@_check("FRAME-006", "a device index >= DEVICE_COUNT closes the connection (every device-taking command)", FR,
        section="framing")
def bad_device(ctx: Context) -> None:
    dev = max(ctx.info.device_count, 1)
    p = ctx.protocol
    t = make_tensor(id=1, type=0, ne=(4,))
    cases: list[tuple[str, bytes]] = [
        ("ALLOC_BUFFER", encode_request(p, C.ALLOC_BUFFER, {"device": dev, "size": 16})),
        ("GET_ALIGNMENT", encode_request(p, C.GET_ALIGNMENT, {"device": dev})),
        ("GET_MAX_SIZE", encode_request(p, C.GET_MAX_SIZE, {"device": dev})),
        ("GET_DEVICE_MEMORY", encode_request(p, C.GET_DEVICE_MEMORY, {"device": dev})),
        ("GET_ALLOC_SIZE", encode_request(p, C.GET_ALLOC_SIZE, {"device": dev, "tensor": t, "srcs": _srcs()})),
        ("GRAPH_RECOMPUTE", encode_request(p, C.GRAPH_RECOMPUTE, {"device": dev})),
    ]
    if p.spec(C.GET_DEVICE_SUPPORTS_OP) is not None:
        cases.append(("GET_DEVICE_SUPPORTS_OP",
                      encode_request(p, C.GET_DEVICE_SUPPORTS_OP, {"device": dev, "op": t, "srcs": _srcs()})))
    for name, sent in cases:
        client = ctx.connect()
        send_and_expect_close(ctx, client, sent, f"{name} on device {dev}")
        client.close()
    buf = session(ctx)
    nodes, tensors = add_graph(buf)
    send_and_expect_close(ctx, buf.client, graph_bytes(dev, nodes, tensors), f"GRAPH_COMPUTE on device {dev}")


@_check("FRAME-007", "an unknown buffer handle (0 or never allocated) closes BUFFER_GET_BASE/FREE_BUFFER/BUFFER_CLEAR",
        FR, section=C.BUFFER_GET_BASE)
def unknown_handle(ctx: Context) -> None:
    p = ctx.protocol
    for handle in (0, 0x5EED_0000_0000_1234):
        for cmd, extra in ((C.BUFFER_GET_BASE, {}), (C.FREE_BUFFER, {}), (C.BUFFER_CLEAR, {"value": 0x41})):
            buf = session(ctx)
            if handle == buf.handle:
                continue
            sent = encode_request(p, cmd, {"remote_ptr": handle, **extra})
            send_and_expect_close(ctx, buf.client, sent, f"{cmd.name} of handle {handle:#x}")
            buf.client.close()


@_check("FRAME-008", "a tensor whose type is >= GGML_TYPE_COUNT (43) closes the connection", FR, section="rpc_tensor")
def bad_type(ctx: Context) -> None:
    def get(buf: Buf) -> bytes:
        t = buf.tensor(0, 16)
        t["type"] = 43
        return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})

    def init(buf: Buf) -> bytes:
        t = buf.tensor(0, 16)
        t["type"] = 200
        return encode_request(ctx.protocol, C.INIT_TENSOR, {"tensor": t})

    bad_on_fresh(ctx, get, "GET_TENSOR of a type-43 tensor")
    bad_on_fresh(ctx, init, "INIT_TENSOR of a type-200 tensor")


@_check("FRAME-009", "a tensor of a removed type (block size 0) closes the connection", FR, section="enum-types")
def removed_type(ctx: Context) -> None:
    for type_id in (4, 31):
        def get(buf: Buf, type_id: int = type_id) -> bytes:
            t = buf.tensor(0, 16)
            t["type"] = type_id
            return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})

        bad_on_fresh(ctx, get, f"GET_TENSOR of a type-{type_id} tensor")


@_check("FRAME-010", "a tensor whose data lies outside its buffer gets no reply bytes (closed)", FR,
        section="rpc_tensor")
def data_outside_buffer(ctx: Context) -> None:
    for where, delta in (("past the end", 4096), ("before the base", -64)):
        def get(buf: Buf, delta: int = delta) -> bytes:
            t = buf.tensor(0, 16, data=(buf.base + delta) % (1 << 64))
            return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})

        bad_on_fresh(ctx, get, f"GET_TENSOR of a tensor {where} of its buffer")


@_check("FRAME-011", "a tensor whose data + nbytes wraps around 2^64 gets no reply bytes (closed)", FR,
        section="rpc_tensor")
def data_wraps(ctx: Context) -> None:
    def get(buf: Buf) -> bytes:
        t = buf.tensor(0, 64, data=(1 << 64) - 16)
        return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})

    bad_on_fresh(ctx, get, "GET_TENSOR of a tensor wrapping the address space")


def _set_tensor(ctx: Context, t: dict, offset: int, data: bytes) -> bytes:
    fields = {"tensor": t, "offset": offset}
    if ctx.protocol.cache_rule.flag_field:
        fields[ctx.protocol.cache_rule.flag_field] = 0
    return encode_request(ctx.protocol, C.SET_TENSOR, fields, data)


@_check("FRAME-012", "SET_TENSOR shorter than its header closes the connection", FR, section=C.SET_TENSOR)
def set_tensor_short(ctx: Context) -> None:
    header = ctx.protocol.commands[C.SET_TENSOR].request.header_size
    bad_on_fresh(ctx, lambda buf: raw_request(C.SET_TENSOR, bytes(header - 1)), f"SET_TENSOR of {header - 1} bytes")


@_check("FRAME-013", "SET_TENSOR to a tensor without a known buffer closes the connection", FR, section=C.SET_TENSOR)
def set_tensor_no_buffer(ctx: Context) -> None:
    for handle in (0, 0x5EED_0000_0000_4321):
        bad_on_fresh(ctx, lambda buf, h=handle: _set_tensor(ctx, buf.tensor(0, 16, buffer=h), 0, b"\x41" * 16),
                     f"SET_TENSOR with buffer {handle:#x}")


@_check("FRAME-014", "SET_TENSOR whose region leaves the buffer closes the connection", FR, section=C.SET_TENSOR)
def set_tensor_outside(ctx: Context) -> None:
    def at_end(buf: Buf) -> bytes:
        return _set_tensor(ctx, buf.tensor(0, buf.size), buf.size, b"\x41")

    def overlong(buf: Buf) -> bytes:
        return _set_tensor(ctx, buf.tensor(buf.size - 16, 16), 0, b"\x41" * 32)

    def empty_at_end(buf: Buf) -> bytes:
        return _set_tensor(ctx, buf.tensor(0, buf.size), buf.size, b"")

    bad_on_fresh(ctx, at_end, "SET_TENSOR at offset == buffer size")
    bad_on_fresh(ctx, empty_at_end, "SET_TENSOR of 0 bytes at offset == buffer size")
    bad_on_fresh(ctx, overlong, "SET_TENSOR running 16 bytes past the buffer")


@_check("FRAME-015", "SET_TENSOR inside the buffer but past the tensor's nbytes closes the connection", FR,
        section=C.SET_TENSOR)
def set_tensor_past_nbytes(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _set_tensor(ctx, buf.tensor(0, 16), 8, b"\x41" * 16),
                 "SET_TENSOR of 16 bytes at offset 8 of a 16-byte tensor")


def _get(ctx: Context, t: dict, offset: int, size: int) -> bytes:
    return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": offset, "size": size})


@_check("FRAME-016", "GET_TENSOR of a tensor without a known buffer closes the connection", FR, section=C.GET_TENSOR)
def get_tensor_no_buffer(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _get(ctx, buf.tensor(0, 16, buffer=0), 0, 16), "GET_TENSOR with buffer 0")


@_check("FRAME-017", "GET_TENSOR whose region leaves the buffer closes without a byte", FR, section=C.GET_TENSOR)
def get_tensor_outside(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _get(ctx, buf.tensor(buf.size - 16, 16), 0, 64),
                 "GET_TENSOR of 64 bytes from 16 bytes before the buffer end")
    bad_on_fresh(ctx, lambda buf: _get(ctx, buf.tensor(0, buf.size), buf.size, 1),
                 "GET_TENSOR at offset == buffer size")


@_check("FRAME-018", "GET_TENSOR inside the buffer but past the tensor's nbytes gets no reply bytes", FR,
        section=C.GET_TENSOR)
def get_tensor_past_nbytes(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _get(ctx, buf.tensor(0, 16), 8, 16),
                 "GET_TENSOR of 16 bytes at offset 8 of a 16-byte tensor")


def _memset(ctx: Context, t: dict, offset: int, size: int, value: int = 0x41) -> bytes:
    return encode_request(ctx.protocol, C.MEMSET_TENSOR, {"tensor": t, "offset": offset, "size": size, "value": value})


@_check("FRAME-019", "MEMSET_TENSOR of a tensor without a known buffer closes the connection", FR,
        section=C.MEMSET_TENSOR)
def memset_no_buffer(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _memset(ctx, buf.tensor(0, 16, buffer=0), 0, 16), "MEMSET_TENSOR with buffer 0")


@_check("FRAME-020", "MEMSET_TENSOR past the tensor's nbytes closes the connection", FR, section=C.MEMSET_TENSOR)
def memset_past_nbytes(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _memset(ctx, buf.tensor(0, 16), 8, 16), "MEMSET_TENSOR of 16 bytes at offset 8")
    bad_on_fresh(ctx, lambda buf: _memset(ctx, buf.tensor(0, 16), 17, 0), "MEMSET_TENSOR at offset 17 of 16 bytes")


@_check("FRAME-021", "COPY_TENSOR with a tensor without a known buffer closes the connection", FR,
        section=C.COPY_TENSOR)
def copy_no_buffer(ctx: Context) -> None:
    for side in ("src", "dst"):
        def build(buf: Buf, side: str = side) -> bytes:
            pair = {"src": buf.tensor(0, 16, id=1), "dst": buf.tensor(64, 16, id=2)}
            pair[side]["buffer"] = 0
            return encode_request(ctx.protocol, C.COPY_TENSOR, pair)

        bad_on_fresh(ctx, build, f"COPY_TENSOR with {side}.buffer 0")


@_check("FRAME-022", "COPY_TENSOR whose source does not fit in the destination's buffer closes the connection", FR,
        section=C.COPY_TENSOR)
def copy_overflow(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        src = buf.tensor(0, 64, id=1)
        dst = buf.tensor(buf.size - 16, 16, id=2)
        return encode_request(ctx.protocol, C.COPY_TENSOR, {"src": src, "dst": dst})

    bad_on_fresh(ctx, build, "COPY_TENSOR of 64 bytes to 16 bytes before the buffer end")


@_check("FRAME-023", "INIT_TENSOR of a tensor without a buffer is ignored (connection stays open)", FR,
        level=Level.SHOULD, section=C.INIT_TENSOR)
def init_no_buffer(ctx: Context) -> None:
    buf = session(ctx)
    t = buf.tensor(0, 16)
    t.update(buffer=0, data=0)
    sent = encode_request(ctx.protocol, C.INIT_TENSOR, {"tensor": t})
    buf.client.send_raw(sent)
    expect_open(ctx, buf.client, sent, "INIT_TENSOR with buffer 0")


@_check("FRAME-024", "GET_ALLOC_SIZE of a tensor with an invalid type closes the connection", FR,
        section=C.GET_ALLOC_SIZE)
def alloc_size_bad_type(ctx: Context) -> None:
    t = make_tensor(id=1, type=0, ne=(4,))
    t["type"] = 43
    sent = encode_request(ctx.protocol, C.GET_ALLOC_SIZE, {"device": 0, "tensor": t, "srcs": _srcs()})
    send_and_expect_close(ctx, ctx.connect(), sent, "GET_ALLOC_SIZE of a type-43 tensor")


@_check("FRAME-025", "GRAPH_COMPUTE shorter than 8 bytes closes the connection", FR, section=C.GRAPH_COMPUTE)
def graph_tiny(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.GRAPH_COMPUTE, bytes(4)), "GRAPH_COMPUTE of 4 bytes")


@_check("FRAME-026", "GRAPH_COMPUTE shorter than its node ids closes the connection", FR, section=C.GRAPH_COMPUTE)
def graph_short_nodes(ctx: Context) -> None:
    body = struct.pack("<II", 0, 1000) + u64(1)
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.GRAPH_COMPUTE, body),
                          "GRAPH_COMPUTE claiming 1000 nodes in 16 bytes")


@_check("FRAME-027", "GRAPH_COMPUTE shorter than its tensors closes the connection", FR, section=C.GRAPH_COMPUTE)
def graph_short_tensors(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        payload = graph_bytes(0, nodes, tensors)[REQUEST_HEADER_SIZE:]
        return raw_request(C.GRAPH_COMPUTE, payload[: -TENSOR_LAYOUT.size])  # the count still says 3

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE claiming 3 tensors, carrying 2")


@_check("FRAME-028", "GRAPH_COMPUTE naming a node id that is not among its tensors closes the connection", FR,
        section=C.GRAPH_COMPUTE)
def graph_unknown_node(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        _nodes, tensors = add_graph(buf)
        return graph_bytes(0, [0xDEAD], tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE with node id 0xdead")


@_check("FRAME-029", "GRAPH_COMPUTE with a tensor that has data but no buffer closes the connection", FR,
        section=C.GRAPH_COMPUTE)
def graph_data_without_buffer(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        tensors[0]["buffer"] = 0  # data still points somewhere: must not be trusted
        return graph_bytes(0, nodes, tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE whose source has buffer 0 and data != 0")


@_check("FRAME-030", "GRAPH_COMPUTE with a source id that resolves to no tensor closes the connection", FR,
        section=C.GRAPH_COMPUTE)
def graph_unresolved_src(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        tensors[2]["src"][1] = 0xBEEF
        return graph_bytes(0, nodes, tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE whose node has src[1] = 0xbeef (absent)")


@_check("FRAME-031", "GRAPH_COMPUTE with node id 0 (a null node) closes the connection", FR, section=C.GRAPH_COMPUTE)
def graph_null_node(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: graph_bytes(0, [0], []), "GRAPH_COMPUTE with node id 0 and no tensors")


@_check("FRAME-032", "GRAPH_RECOMPUTE without a stored graph closes the connection", FR, section=C.GRAPH_RECOMPUTE)
def recompute_without_graph(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), encode_request(ctx.protocol, C.GRAPH_RECOMPUTE, {"device": 0}),
                          "GRAPH_RECOMPUTE before any GRAPH_COMPUTE")


@_check("FRAME-033", "a payload size claim beyond what the server can hold closes the connection", FR,
        level=Level.SHOULD, section="framing")
def huge_claim(ctx: Context) -> None:
    buf = session(ctx)
    head = _set_tensor(ctx, buf.tensor(0, 16), 0, b"")[9:]
    sent = raw_request(C.SET_TENSOR, head, size=1 << 62)
    buf.client.send_raw(sent)
    expect_close(ctx, buf.client, sent, "SET_TENSOR header claiming 2^62 payload bytes", probe=False)
    buf.client.close()
    client = ctx.connect()
    sent = raw_request(C.GRAPH_COMPUTE, b"", size=1 << 62)
    client.send_raw(sent)
    expect_close(ctx, client, sent, "GRAPH_COMPUTE claiming 2^62 payload bytes", probe=False)


# ---- what upstream 6.0/7.0 dies of (protocol.md §10, §12): the server must refuse, never die ---------------------

#: The smallest size header no container can hold (upstream: an uncaught length error, SIGABRT).
HUGE_SIZES = (1 << 63, (1 << 64) - 1)


def _claim(ctx: Context, cmd: C, head: bytes, size: int, rule: str) -> None:
    """A fresh connection sends ``head`` under a header claiming ``size`` payload bytes: it must be closed."""
    client = ctx.connect()
    sent = raw_request(cmd, head, size=size)
    client.send_raw(sent)
    expect_close(ctx, client, sent, rule, probe=False)
    client.close()


@_check("FRAME-036", "a SET_TENSOR size header of 2^63 or more closes the connection (the server survives)", FR,
        level=Level.SHOULD, section=C.SET_TENSOR)
def set_tensor_claim_2_63(ctx: Context) -> None:
    for size in HUGE_SIZES:
        buf = session(ctx)
        head = _set_tensor(ctx, buf.tensor(0, 16), 0, b"")[REQUEST_HEADER_SIZE:]
        sent = raw_request(C.SET_TENSOR, head, size=size)
        buf.client.send_raw(sent)
        expect_close(ctx, buf.client, sent, f"SET_TENSOR header claiming {size:#x} payload bytes", probe=False)
        buf.client.close()


@_check("FRAME-037", "a GRAPH_COMPUTE size header of 2^63 or more closes the connection (the server survives)", FR,
        level=Level.SHOULD, section=C.GRAPH_COMPUTE)
def graph_claim_2_63(ctx: Context) -> None:
    for size in HUGE_SIZES:
        # A plausible start (device 0, one node) so that only the size is wrong.
        _claim(ctx, C.GRAPH_COMPUTE, struct.pack("<II", 0, 1), size,
               f"GRAPH_COMPUTE header claiming {size:#x} payload bytes")


#: Upstream's recursive graph rebuild overflows its stack here (§12: 100,000 computes, 300,000 dies).
DEEP_CHAIN = 300_000


def chain_graph(depth: int, device: int = 0) -> bytes:
    """A GRAPH_COMPUTE whose one node ends a ``depth``-long src chain (ids 1..depth, each the src of the next).

    No tensor has a buffer or data, and none has the COMPUTE flag: a server that rebuilds the graph has nothing to
    run, so the only cost is the rebuild itself.  Built as one numpy array: 300,000 dicts would take longer to
    encode than the server takes to die.
    """
    tensors = np.zeros(depth, dtype=TENSOR_DTYPE)
    ids = np.arange(1, depth + 1, dtype=np.uint64)
    tensors["id"] = ids
    tensors["type"] = int(GgmlType.F32)
    tensors["ne"] = (4, 1, 1, 1)
    tensors["nb"] = (4, 16, 16, 16)
    tensors["src"][1:, 0] = ids[:-1]
    body = struct.pack("<II", device, 1) + struct.pack("<Q", depth) + struct.pack("<I", depth) + tensors.tobytes()
    return raw_request(C.GRAPH_COMPUTE, body)


def expect_open_or_closed(ctx: Context, client: RpcClient, sent: bytes, rule: str) -> str:
    """After ``sent`` the server either goes on (the probe is answered, nothing before it) or closes without a
    byte; which one it did is returned (and noted)."""
    try:
        client.send_raw(PROBE)
    except (ConnectionClosed, OSError):
        pass
    want = REPLY_HEADER.pack(PROBE_REPLY_SIZE)
    got = recv_upto(client.sock, len(want) + PROBE_REPLY_SIZE, ctx.timeout)
    short = hexdump(sent, 48)
    if not got:
        if not client.expect_closed(timeout=ctx.timeout):
            raise fail(f"{rule}: neither an answer to the next command nor a close within {ctx.timeout:g} s",
                       sent=short, expected="the next command answered, or the connection closed",
                       got="connection open, silent")
        ctx.note(rule, sent=short, expected="processed or closed", got="closed, no reply bytes")
        return "refused"
    if len(got) != len(want) + PROBE_REPLY_SIZE or got[: len(want)] != want:
        raise fail(f"{rule}: bytes arrived that answer no command", sent=short,
                   expected=f"only the DEVICE_COUNT reply: {hexdump(want)} + {PROBE_REPLY_SIZE} bytes",
                   got=hexdump(got))
    ctx.note(rule, sent=short, expected="processed or closed", got="processed, connection open")
    return "processed"


@_check("FRAME-038", "a GRAPH_COMPUTE whose src chain is 300,000 deep is computed or refused, never a crash", FR,
        section=C.GRAPH_COMPUTE)
def graph_deep_chain(ctx: Context) -> str:
    client = ctx.connect(timeout=max(ctx.timeout, 30.0))  # 89 MB of tensors on the way
    sent = chain_graph(DEEP_CHAIN)
    client.send_raw(sent)
    how = expect_open_or_closed(ctx, client, sent, f"GRAPH_COMPUTE with a {DEEP_CHAIN:,}-deep src chain")
    return f"{DEEP_CHAIN:,}-deep chain {how}"


#: Rounds of FRAME-039 (each: HELLO, GET_TENSOR of 1 MiB, GET_ALIGNMENT, DEVICE_COUNT, each left unread).
CLOSE_ROUNDS = 3


def _close_unread(ctx: Context, client: RpcClient, sent: bytes, what: str) -> None:
    """Send ``sent`` and close at once, reading nothing; then a new connection must be served."""
    ctx.note(f"{what}, then close before the reply is read", sent=hexdump(sent, 48))
    client.send_raw(sent)
    client.close()
    # A server serving one connection at a time takes this one only once it is done with the closed one, so a
    # server that dies writing its reply is found dead here, in this step.
    after = ctx.connect()
    after.device_count()
    after.close()


@_check("FRAME-039", "a client that closes before reading its reply does not take the server down", FR,
        level=Level.SHOULD, section="framing")
def close_before_reply(ctx: Context) -> None:
    # Whether a server dies of this is a race (its second write must meet the reset the first one provoked), so
    # each way of leaving early is tried a few times; a server that survives once survives every round.
    for round_ in range(1, CLOSE_ROUNDS + 1):
        # HELLO first: its reply goes out as two writes upstream (size, then body).
        sock = socket.create_connection((ctx.target.host, ctx.target.port), timeout=ctx.timeout)
        hello = raw_request(C.HELLO, bytes(ctx.protocol.spec(C.HELLO).request.header_size))
        ctx.note(f"HELLO, then close before the reply is read (round {round_})", sent=hexdump(hello))
        sock.sendall(hello)
        sock.close()
        after = ctx.connect()
        after.device_count()
        after.close()
        buf = session(ctx, 1 << 20)
        _close_unread(ctx, buf.client, _get(ctx, buf.tensor(0, buf.size), 0, buf.size),
                      f"GET_TENSOR of 1 MiB (round {round_})")
        for cmd, fields in ((C.GET_ALIGNMENT, {"device": 0}), (C.DEVICE_COUNT, {})):
            _close_unread(ctx, ctx.connect(), encode_request(ctx.protocol, cmd, fields),
                          f"{cmd.name} (round {round_})")


@_check("FRAME-040", "a SET_TENSOR in the other major's layout (cache_flag byte present or missing) is refused", FR,
        section=C.SET_TENSOR)
def set_tensor_other_layout(ctx: Context) -> str:
    buf = session(ctx)
    t = buf.tensor(0, 16)  # room after the tensor: the shifted bytes stay inside the buffer
    data = b"\x41" * 16  # exactly the tensor: the normal client case
    if ctx.protocol.cache_rule.flag_field:
        # v6 layout to a v7 server: the offset's low byte reads as cache_flag, the first data byte as the offset's
        # top byte, so the offset lands far outside the buffer.
        other = V6
        sent = encode_request(V6, C.SET_TENSOR, {"tensor": t, "offset": 0}, data)
    else:
        # v7 layout to a v6 server: cache_flag and 7 offset bytes read as the offset (0), the offset's last byte as
        # one extra leading data byte: 17 bytes into a 16-byte tensor (upstream v6 asserts and dies).
        other = V7
        sent = encode_request(V7, C.SET_TENSOR, {"tensor": t, "cache_flag": 0, "offset": 0}, data)
    send_and_expect_close(ctx, buf.client, sent, f"SET_TENSOR in the {other.label} layout")
    return f"{other.label}-layout SET_TENSOR refused"
