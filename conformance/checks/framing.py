"""Framing and bad input: one check per validation rule of the protocol (spec/PROTOCOL.md#rules).

MUST: the server closes where the rule says so, and no reply ever carries bytes (least of all bytes from outside a
buffer).  SHOULD (checked by the runner after each of these): the server still accepts a new connection — upstream
6.0/7.0 builds die on several of these inputs (assertion or crash), which is reported as a SHOULD failure.
"""

from __future__ import annotations

import struct

from ggml_rpc.conformance.checks._support import (
    Buf,
    bad_on_fresh,
    expect_close,
    expect_open,
    raw_request,
    send_and_expect_close,
    session,
    u64,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.harness import Category, Context, Level
from ggml_rpc.spec import V7_0_1, GgmlOp, Protocol, TensorFlag, encode_request, make_tensor, null_tensor
from ggml_rpc.spec import Command as C
from ggml_rpc.spec.codec import REQUEST_HEADER_SIZE, TENSOR_LAYOUT
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


def graph_bytes(protocol: Protocol, device: int, nodes: list[int], tensors: list[dict], uid: int = 1) -> bytes:
    """A GRAPH_COMPUTE request in the version's layout (8.0.0: under graph ``uid``)."""
    fields = {"device": device, "nodes": nodes, "tensors": tensors}
    if protocol.graph_cache_max is not None:
        fields["uid"] = uid
    return encode_request(protocol, C.GRAPH_COMPUTE, fields)


def recompute_bytes(protocol: Protocol, device: int, uid: int = 1) -> bytes:
    """A GRAPH_RECOMPUTE request in the version's layout (8.0.0: of graph ``uid``)."""
    fields = {"device": device} if protocol.graph_cache_max is None else {"device": device, "uid": uid}
    return encode_request(protocol, C.GRAPH_RECOMPUTE, fields)


@_check("FRAME-001", "a command id at or above RPC_CMD_COUNT closes the connection", FR, section="enum-commands",
        rules=("DECODE",))
def unknown_command(ctx: Context) -> None:
    for cmd in (ctx.protocol.command_count, 200, 255):
        client = ctx.connect()
        send_and_expect_close(ctx, client, raw_request(cmd, b""), f"command {cmd}")
        client.close()


@_check("FRAME-002", "command NONE (a client-side sentinel: 18, 23 from 8.0.0) closes the connection", FR,
        section="enum-commands", rules=("DECODE",))
def none_command(ctx: Context) -> None:
    sentinel = ctx.info.protocol.sentinel if ctx.info.protocol is not None else int(C.NONE)
    send_and_expect_close(ctx, ctx.connect(), raw_request(sentinel, b""), f"command {sentinel} (NONE)")


@_check("FRAME-003", "GET_DEVICE_SUPPORTS_OP (19) closes the connection on servers before 7.0.1", FR,
        section="enum-commands", max_version=(7, 0, 0), rules=("DECODE",))
def supports_op_before_701(ctx: Context) -> None:
    # encoded with the 7.0.1 table, the first to have the command
    sent = encode_request(V7_0_1, C.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": null_tensor(), "srcs": _srcs()})
    send_and_expect_close(ctx, ctx.connect(), sent, "command 19 on a server without it")


@_check("FRAME-004", "a fixed-size request with the wrong size closes the connection (payload unread)", FR,
        section="framing", rules=("DECODE",))
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


@_check("FRAME-005", "DEVICE_COUNT with a non-empty payload closes the connection", FR, section=C.DEVICE_COUNT,
        rules=("DECODE",))
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
        ("GRAPH_RECOMPUTE", recompute_bytes(p, dev)),
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
    send_and_expect_close(ctx, buf.client, graph_bytes(ctx.protocol, dev, nodes, tensors),
                          f"GRAPH_COMPUTE on device {dev}")


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


@_check("FRAME-008", "a tensor whose type is >= GGML_TYPE_COUNT (43) closes the connection", FR, section="rpc_tensor",
        rules=("TENSOR-TYPE",))
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


@_check("FRAME-009", "a tensor of a removed type (block size 0) closes the connection", FR, section="enum-types",
        rules=("TENSOR-REMOVED-TYPE",))
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


def set_tensor_request(ctx: Context, t: dict, offset: int, data: bytes) -> bytes:
    fields = {"tensor": t, "offset": offset}
    if ctx.protocol.cache_rule.flag_field:
        fields[ctx.protocol.cache_rule.flag_field] = 0
    return encode_request(ctx.protocol, C.SET_TENSOR, fields, data)


@_check("FRAME-012", "SET_TENSOR shorter than its header closes the connection", FR, section=C.SET_TENSOR,
        rules=("DECODE",))
def set_tensor_short(ctx: Context) -> None:
    header = ctx.protocol.commands[C.SET_TENSOR].request.header_size
    bad_on_fresh(ctx, lambda buf: raw_request(C.SET_TENSOR, bytes(header - 1)), f"SET_TENSOR of {header - 1} bytes")


@_check("FRAME-013", "SET_TENSOR to a tensor without a known buffer closes the connection", FR, section=C.SET_TENSOR)
def set_tensor_no_buffer(ctx: Context) -> None:
    for handle in (0, 0x5EED_0000_0000_4321):
        bad_on_fresh(ctx, lambda buf, h=handle: set_tensor_request(ctx, buf.tensor(0, 16, buffer=h), 0, b"\x41" * 16),
                     f"SET_TENSOR with buffer {handle:#x}")


@_check("FRAME-014", "SET_TENSOR whose region leaves the buffer closes the connection", FR, section=C.SET_TENSOR,
        rules=("REGION-PAST-TENSOR",))
def set_tensor_outside(ctx: Context) -> None:
    def at_end(buf: Buf) -> bytes:
        return set_tensor_request(ctx, buf.tensor(0, buf.size), buf.size, b"\x41")

    def overlong(buf: Buf) -> bytes:
        return set_tensor_request(ctx, buf.tensor(buf.size - 16, 16), 0, b"\x41" * 32)

    def empty_at_end(buf: Buf) -> bytes:
        return set_tensor_request(ctx, buf.tensor(0, buf.size), buf.size, b"")

    bad_on_fresh(ctx, at_end, "SET_TENSOR at offset == buffer size")
    bad_on_fresh(ctx, empty_at_end, "SET_TENSOR of 0 bytes at offset == buffer size")
    bad_on_fresh(ctx, overlong, "SET_TENSOR running 16 bytes past the buffer")


@_check("FRAME-015", "SET_TENSOR inside the buffer but past the tensor's nbytes closes the connection", FR,
        section=C.SET_TENSOR, rules=("REGION-PAST-TENSOR",))
def set_tensor_past_nbytes(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: set_tensor_request(ctx, buf.tensor(0, 16), 8, b"\x41" * 16),
                 "SET_TENSOR of 16 bytes at offset 8 of a 16-byte tensor")


def get_tensor_request(ctx: Context, t: dict, offset: int, size: int) -> bytes:
    return encode_request(ctx.protocol, C.GET_TENSOR, {"tensor": t, "offset": offset, "size": size})


@_check("FRAME-016", "GET_TENSOR of a tensor without a known buffer closes the connection", FR, section=C.GET_TENSOR)
def get_tensor_no_buffer(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: get_tensor_request(ctx, buf.tensor(0, 16, buffer=0), 0, 16),
                 "GET_TENSOR with buffer 0")


@_check("FRAME-017", "GET_TENSOR whose region leaves the buffer closes without a byte", FR, section=C.GET_TENSOR,
        rules=("REGION-PAST-TENSOR",))
def get_tensor_outside(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: get_tensor_request(ctx, buf.tensor(buf.size - 16, 16), 0, 64),
                 "GET_TENSOR of 64 bytes from 16 bytes before the buffer end")
    bad_on_fresh(ctx, lambda buf: get_tensor_request(ctx, buf.tensor(0, buf.size), buf.size, 1),
                 "GET_TENSOR at offset == buffer size")


@_check("FRAME-018", "GET_TENSOR inside the buffer but past the tensor's nbytes gets no reply bytes", FR,
        section=C.GET_TENSOR, rules=("REGION-PAST-TENSOR",))
def get_tensor_past_nbytes(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: get_tensor_request(ctx, buf.tensor(0, 16), 8, 16),
                 "GET_TENSOR of 16 bytes at offset 8 of a 16-byte tensor")


def _memset(ctx: Context, t: dict, offset: int, size: int, value: int = 0x41) -> bytes:
    return encode_request(ctx.protocol, C.MEMSET_TENSOR, {"tensor": t, "offset": offset, "size": size, "value": value})


@_check("FRAME-019", "MEMSET_TENSOR of a tensor without a known buffer closes the connection", FR,
        section=C.MEMSET_TENSOR)
def memset_no_buffer(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: _memset(ctx, buf.tensor(0, 16, buffer=0), 0, 16), "MEMSET_TENSOR with buffer 0")


@_check("FRAME-020", "MEMSET_TENSOR past the tensor's nbytes closes the connection", FR, section=C.MEMSET_TENSOR,
        rules=("REGION-PAST-TENSOR",))
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
        section=C.COPY_TENSOR, rules=("COPY-FITS-DST",))
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


@_check("FRAME-025", "GRAPH_COMPUTE shorter than 8 bytes closes the connection", FR, section=C.GRAPH_COMPUTE,
        rules=("DECODE",))
def graph_tiny(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.GRAPH_COMPUTE, bytes(4)), "GRAPH_COMPUTE of 4 bytes")


@_check("FRAME-026", "GRAPH_COMPUTE shorter than its node ids closes the connection", FR, section=C.GRAPH_COMPUTE,
        rules=("DECODE",))
def graph_short_nodes(ctx: Context) -> None:
    head = graph_bytes(ctx.protocol, 0, [], [])[REQUEST_HEADER_SIZE:-4]  # the fixed fields and n_nodes
    body = head[:-4] + struct.pack("<I", 1000) + u64(1)
    send_and_expect_close(ctx, ctx.connect(), raw_request(C.GRAPH_COMPUTE, body),
                          f"GRAPH_COMPUTE claiming 1000 nodes in {len(body)} bytes")


@_check("FRAME-027", "GRAPH_COMPUTE shorter than its tensors closes the connection", FR, section=C.GRAPH_COMPUTE,
        rules=("DECODE",))
def graph_short_tensors(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        payload = graph_bytes(ctx.protocol, 0, nodes, tensors)[REQUEST_HEADER_SIZE:]
        return raw_request(C.GRAPH_COMPUTE, payload[: -TENSOR_LAYOUT.size])  # the count still says 3

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE claiming 3 tensors, carrying 2")


@_check("FRAME-028", "GRAPH_COMPUTE naming a node id that is not among its tensors closes the connection", FR,
        section=C.GRAPH_COMPUTE, rules=("GRAPH-NODE-UNKNOWN",))
def graph_unknown_node(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        _nodes, tensors = add_graph(buf)
        return graph_bytes(ctx.protocol, 0, [0xDEAD], tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE with node id 0xdead")


@_check("FRAME-029", "GRAPH_COMPUTE with a tensor that has data but no buffer closes the connection", FR,
        section=C.GRAPH_COMPUTE)
def graph_data_without_buffer(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        tensors[0]["buffer"] = 0  # data still points somewhere: must not be trusted
        return graph_bytes(ctx.protocol, 0, nodes, tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE whose source has buffer 0 and data != 0")


@_check("FRAME-030", "GRAPH_COMPUTE with a source id that resolves to no tensor closes the connection", FR,
        section=C.GRAPH_COMPUTE)
def graph_unresolved_src(ctx: Context) -> None:
    def build(buf: Buf) -> bytes:
        nodes, tensors = add_graph(buf)
        tensors[2]["src"][1] = 0xBEEF
        return graph_bytes(ctx.protocol, 0, nodes, tensors)

    bad_on_fresh(ctx, build, "GRAPH_COMPUTE whose node has src[1] = 0xbeef (absent)")


@_check("FRAME-031", "GRAPH_COMPUTE with node id 0 (a null node) closes the connection", FR, section=C.GRAPH_COMPUTE,
        rules=("GRAPH-NULL-NODE",))
def graph_null_node(ctx: Context) -> None:
    bad_on_fresh(ctx, lambda buf: graph_bytes(ctx.protocol, 0, [0], []), "GRAPH_COMPUTE with node id 0 and no tensors")


@_check("FRAME-032", "GRAPH_RECOMPUTE without a stored graph closes the connection", FR, section=C.GRAPH_RECOMPUTE)
def recompute_without_graph(ctx: Context) -> None:
    send_and_expect_close(ctx, ctx.connect(), recompute_bytes(ctx.protocol, 0),
                          "GRAPH_RECOMPUTE before any GRAPH_COMPUTE")


@_check("FRAME-033", "a payload size claim beyond what the server can hold closes the connection", FR,
        level=Level.SHOULD, section="framing", rules=("DECODE", "REGION-PAST-TENSOR"))
def huge_claim(ctx: Context) -> None:
    buf = session(ctx)
    head = set_tensor_request(ctx, buf.tensor(0, 16), 0, b"")[9:]
    sent = raw_request(C.SET_TENSOR, head, size=1 << 62)
    buf.client.send_raw(sent)
    expect_close(ctx, buf.client, sent, "SET_TENSOR header claiming 2^62 payload bytes", probe=False)
    buf.client.close()
    client = ctx.connect()
    sent = raw_request(C.GRAPH_COMPUTE, b"", size=1 << 62)
    client.send_raw(sent)
    expect_close(ctx, client, sent, "GRAPH_COMPUTE claiming 2^62 payload bytes", probe=False)
