"""Data path: buffers, tensor reads and writes, fills, copies, and the commands that must stay silent."""

from __future__ import annotations

from ggml_rpc.conformance.checks._leaks import LeakReport, classify
from ggml_rpc.conformance.checks._support import (
    F32,
    Buf,
    alloc,
    expect_bytes,
    expect_open,
    expect_silence_then_reply,
    fail,
    nonce,
    read_back,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.framing import add_graph, graph_bytes, recompute_bytes
from ggml_rpc.conformance.harness import Category, Context, Level, hexdump
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import encode_request, make_tensor, null_tensor, tensor_nbytes
from ggml_rpc.spec.tensor import GGML_MAX_SRC

DA = Category.DATA


@_check("DATA-001", "ALLOC_BUFFER gives a non-zero handle and at least the bytes asked for", DA,
        section=C.ALLOC_BUFFER)
def alloc_buffer(ctx: Context) -> str:
    client = ctx.connect()
    handle, size = client.alloc_buffer(0, 1 << 20)
    ctx.note("ALLOC_BUFFER 1 MiB", got=f"handle {handle:#x}, size {size}")
    if handle == 0 or size < 1 << 20:
        raise fail("ALLOC_BUFFER of 1 MiB refused or short", expected="handle != 0, remote_size >= 1048576",
                   got=f"handle {handle:#x}, remote_size {size}")
    other, _ = client.alloc_buffer(0, 4096)
    if other == handle:
        raise fail("two live buffers got the same handle", got=f"{handle:#x} twice")
    return f"handle {handle:#x}"


@_check("DATA-002", "BUFFER_GET_BASE is non-zero, stable, and a multiple of the alignment", DA,
        section=C.BUFFER_GET_BASE)
def buffer_base(ctx: Context) -> None:
    client = ctx.connect()
    align = client.get_alignment(0)
    buf = alloc(client, 4096)
    again = client.buffer_get_base(buf.handle)
    if buf.base == 0 or again != buf.base:
        raise fail("base is 0 or changes between calls", expected="same non-zero base twice",
                   got=f"{buf.base:#x}, then {again:#x}")
    if align and buf.base % align:
        raise fail("base is not a multiple of GET_ALIGNMENT", expected=f"multiple of {align}", got=f"{buf.base:#x}",
                   level=Level.SHOULD)


@_check("DATA-003", "GET_ALIGNMENT is a power of two", DA, section=C.GET_ALIGNMENT)
def alignment(ctx: Context) -> str:
    a = ctx.connect().get_alignment(0)
    if a == 0 or a & (a - 1):
        raise fail("alignment is not a power of two", expected="1, 2, 4, 8, …", got=str(a))
    return f"alignment {a}"


@_check("DATA-004", "GET_MAX_SIZE is at least the alignment", DA, section=C.GET_MAX_SIZE)
def max_size(ctx: Context) -> str:
    client = ctx.connect()
    m, a = client.get_max_size(0), client.get_alignment(0)
    if m < max(a, 1):
        raise fail("max buffer size is smaller than the alignment", expected=f">= {a}", got=str(m))
    return f"max size {m:#x}"


@_check("DATA-005", "GET_DEVICE_MEMORY is sane: 0 < total, free <= total", DA, level=Level.SHOULD,
        section=C.GET_DEVICE_MEMORY)
def device_memory(ctx: Context) -> str:
    free, total = ctx.connect().get_device_memory(0)
    if total == 0 or free > total:
        raise fail("device memory is not sane", expected="0 < total and free <= total",
                   got=f"free {free}, total {total}")
    return f"free {free}, total {total}"


def _roundtrip(ctx: Context, size: int, offset: int, n: int, *, tensor_at: int = 0) -> None:
    buf = session(ctx, size)
    payload = nonce(n)
    t = buf.tensor(tensor_at, size - tensor_at)
    buf.client.set_tensor(t, offset, payload)
    got = bytes(buf.client.get_tensor(t, offset, n))
    ctx.note(f"SET_TENSOR then GET_TENSOR of {n} bytes at tensor offset {offset} (data = base + {tensor_at})",
             sent=hexdump(payload, 16), got=hexdump(got, 16))
    expect_bytes("GET_TENSOR after SET_TENSOR", got, payload)


@_check("DATA-006", "SET_TENSOR then GET_TENSOR at offset 0 returns the bytes written", DA, section=C.SET_TENSOR)
def roundtrip_0(ctx: Context) -> None:
    _roundtrip(ctx, 4096, 0, 256)


@_check("DATA-007", "SET_TENSOR then GET_TENSOR at offset 1 returns the bytes written", DA, section=C.SET_TENSOR)
def roundtrip_1(ctx: Context) -> None:
    _roundtrip(ctx, 4096, 1, 255)


@_check("DATA-008", "SET_TENSOR/GET_TENSOR on an unaligned tensor address with an odd length", DA,
        section=C.SET_TENSOR)
def roundtrip_unaligned(ctx: Context) -> None:
    _roundtrip(ctx, 4096, 5, 37, tensor_at=3)


@_check("DATA-009", "a whole 1 MiB buffer written and read back in one request each", DA, section=C.GET_TENSOR)
def roundtrip_whole(ctx: Context) -> None:
    _roundtrip(ctx, 1 << 20, 0, 1 << 20)


@_check("DATA-010", "SET_TENSOR of zero bytes inside the buffer is accepted (connection stays open)", DA,
        section=C.SET_TENSOR)
def set_empty(ctx: Context) -> None:
    buf = session(ctx)
    buf.client.set_tensor(buf.tensor(0, 16), 0, b"")
    expect_open(ctx, buf.client, b"SET_TENSOR of 0 bytes", "SET_TENSOR of 0 bytes")


@_check("DATA-011", "MEMSET_TENSOR fills exactly the requested range", DA, section=C.MEMSET_TENSOR)
def memset(ctx: Context) -> None:
    buf = session(ctx)
    base = nonce(64)
    t = buf.tensor(0, 64)
    buf.client.set_tensor(t, 0, base)
    buf.client.memset_tensor(t, 7, 20, 0xA5)
    want = base[:7] + b"\xa5" * 20 + base[27:]
    expect_bytes("MEMSET_TENSOR of bytes 7..26 to a5", bytes(buf.client.get_tensor(t, 0, 64)), want)


@_check("DATA-012", "MEMSET_TENSOR of zero bytes changes nothing", DA, section=C.MEMSET_TENSOR)
def memset_empty(ctx: Context) -> None:
    buf = session(ctx)
    base = nonce(32)
    t = buf.tensor(0, 32)
    buf.client.set_tensor(t, 0, base)
    buf.client.memset_tensor(t, 4, 0, 0xFF)
    expect_bytes("MEMSET_TENSOR of 0 bytes", bytes(buf.client.get_tensor(t, 0, 32)), base)


@_check("DATA-013", "BUFFER_CLEAR fills the whole buffer with the value", DA, section=C.BUFFER_CLEAR)
def buffer_clear(ctx: Context) -> None:
    buf = session(ctx, 8192)
    buf.client.set_tensor(buf.tensor(0, buf.size), 0, nonce(buf.size))
    buf.client.buffer_clear(buf.handle, 0x3C)
    expect_bytes("BUFFER_CLEAR to 3c", read_back(buf, 0, buf.size), b"\x3c" * buf.size)


@_check("DATA-014", "COPY_TENSOR copies the source's bytes into the destination and answers 1", DA,
        section=C.COPY_TENSOR)
def copy_tensor(ctx: Context) -> None:
    buf = session(ctx)
    src, dst = buf.tensor(0, 100, id=1), buf.tensor(1024, 100, id=2)
    data, around = nonce(100), nonce(132)
    buf.client.set_tensor(buf.tensor(1008, 132, id=3), 0, around)
    buf.client.set_tensor(src, 0, data)
    ok = buf.client.copy_tensor(src, dst)
    got = read_back(buf, 1008, 132)
    want = around[:16] + data + around[116:]
    if ok:
        expect_bytes("COPY_TENSOR (answered 1)", got, want)
    else:
        expect_bytes("COPY_TENSOR answered 0 (declined): destination must be untouched", got, around)
        raise fail("COPY_TENSOR between two tensors of one host buffer was declined", expected="result 1",
                   got="result 0", level=Level.SHOULD)


@_check("DATA-015", "ALLOC_BUFFER of 0 bytes gives a usable zero-size buffer", DA, section=C.ALLOC_BUFFER)
def alloc_zero(ctx: Context) -> None:
    client = ctx.connect()
    handle, size = client.alloc_buffer(0, 0)
    ctx.note("ALLOC_BUFFER 0", got=f"handle {handle:#x}, size {size}")
    if handle == 0 or size != 0:
        raise fail("ALLOC_BUFFER of 0 bytes", expected="non-zero handle, remote_size 0",
                   got=f"handle {handle:#x}, remote_size {size}")
    client.buffer_get_base(handle)
    client.buffer_clear(handle, 0)
    client.free_buffer(handle)
    sent = encode_request(ctx.protocol, C.FREE_BUFFER, {"remote_ptr": handle})
    expect_open(ctx, client, sent, "BUFFER_CLEAR and FREE_BUFFER of the zero-size buffer")


@_check("DATA-016", "after FREE_BUFFER the handle is unknown (BUFFER_GET_BASE on it closes)", DA,
        section=C.FREE_BUFFER, bad_input=True)
def free_buffer(ctx: Context) -> None:
    buf = session(ctx)
    buf.client.free_buffer(buf.handle)
    sent = encode_request(ctx.protocol, C.BUFFER_GET_BASE, {"remote_ptr": buf.handle})
    send_and_expect_close(ctx, buf.client, sent, "BUFFER_GET_BASE of a freed buffer")


@_check("DATA-017", "GET_ALLOC_SIZE is at least the tensor's nbytes", DA, section=C.GET_ALLOC_SIZE)
def alloc_size(ctx: Context) -> None:
    client = ctx.connect()
    buf = alloc(client, 4096)
    for t in (make_tensor(id=1, type=F32, ne=(64, 4)), buf.f32(0, (10, 3), id=2)):
        nbytes = tensor_nbytes(t)
        got = client.get_alloc_size(0, t)
        if got < nbytes:
            raise fail("GET_ALLOC_SIZE below nbytes", expected=f">= {nbytes}", got=str(got))


@_check("DATA-018", "INIT_TENSOR of a tensor in a buffer is accepted and keeps its data", DA, section=C.INIT_TENSOR)
def init_tensor(ctx: Context) -> None:
    buf = session(ctx)
    t = buf.tensor(0, 64)
    data = nonce(64)
    buf.client.set_tensor(t, 0, data)
    buf.client.init_tensor(t)
    expect_bytes("data after INIT_TENSOR", bytes(buf.client.get_tensor(t, 0, 64)), data)


@_check("DATA-019", "SET_TENSOR_HASH of an unknown hash answers 0 and leaves the tensor alone", DA,
        section=C.SET_TENSOR_HASH)
def hash_miss(ctx: Context) -> None:
    buf = session(ctx)
    t = buf.tensor(0, 64)
    data = nonce(64)
    buf.client.set_tensor(t, 0, data)
    hit = buf.client.set_tensor_hash(t, 0, int.from_bytes(nonce(8), "little"))
    if hit:
        raise fail("SET_TENSOR_HASH of a random hash answered 1 (hit)", expected="result 0", got="result 1")
    expect_bytes("tensor after a SET_TENSOR_HASH miss", bytes(buf.client.get_tensor(t, 0, 64)), data)


@_check("DATA-020", "GET_DEVICE_SUPPORTS_OP answers 0 or 1 for a plain op", DA, section=C.GET_DEVICE_SUPPORTS_OP,
        majors=(7,), min_version=(7, 0, 1))
def supports_op(ctx: Context) -> str:
    buf = session(ctx)
    _nodes, tensors = add_graph(buf)
    srcs = [tensors[0], tensors[1]] + [null_tensor() for _ in range(GGML_MAX_SRC - 2)]
    reply = buf.client.request(C.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": tensors[2], "srcs": srcs})
    assert reply is not None
    value = reply.fields["supported"]
    if value not in (0, 1):
        raise fail("GET_DEVICE_SUPPORTS_OP answered neither 0 nor 1", expected="00 or 01", got=f"{value:02x}")
    return f"ADD supported: {bool(value)}"


def _no_reply(ctx: Context, command: C, build) -> None:
    buf = session(ctx)
    sent = build(ctx, buf)
    buf.client.send_raw(sent)
    expect_silence_then_reply(ctx, buf.client, sent, command.name)


def _graph_then(ctx: Context, buf: Buf, recompute: bool) -> bytes:
    nodes, tensors = add_graph(buf)
    sent = graph_bytes(ctx.protocol, 0, nodes, tensors)
    if not recompute:
        return sent
    buf.client.send_raw(sent)
    return recompute_bytes(ctx.protocol, 0)


def _set(ctx: Context, buf: Buf) -> bytes:
    fields = {"tensor": buf.tensor(0, 16), "offset": 0}
    if ctx.protocol.cache_rule.flag_field:
        fields[ctx.protocol.cache_rule.flag_field] = 0
    return encode_request(ctx.protocol, C.SET_TENSOR, fields, nonce(16))


_SILENT = [
    ("DATA-021", C.FREE_BUFFER, lambda ctx, buf: encode_request(ctx.protocol, C.FREE_BUFFER,
                                                              {"remote_ptr": buf.handle})),
    ("DATA-022", C.BUFFER_CLEAR, lambda ctx, buf: encode_request(ctx.protocol, C.BUFFER_CLEAR,
                                                               {"remote_ptr": buf.handle, "value": 1})),
    ("DATA-023", C.SET_TENSOR, _set),
    ("DATA-024", C.INIT_TENSOR, lambda ctx, buf: encode_request(ctx.protocol, C.INIT_TENSOR,
                                                              {"tensor": buf.tensor(0, 16)})),
    ("DATA-025", C.MEMSET_TENSOR, lambda ctx, buf: encode_request(
        ctx.protocol, C.MEMSET_TENSOR, {"tensor": buf.tensor(0, 16), "offset": 0, "size": 16, "value": 7})),
    ("DATA-026", C.GRAPH_COMPUTE, lambda ctx, buf: _graph_then(ctx, buf, False)),
    ("DATA-027", C.GRAPH_RECOMPUTE, lambda ctx, buf: _graph_then(ctx, buf, True)),
]


def _register_silent(check_id: str, command: C, build) -> None:
    def body(ctx: Context) -> None:
        _no_reply(ctx, command, build)

    body.__name__ = f"no_reply_{command.name.lower()}"
    _check(check_id, f"{command.name} sends no reply at all (not even an empty one)", DA, section=command,
           rules=("NO-REPLY",))(body)


for _id, _cmd, _build in _SILENT:
    _register_silent(_id, _cmd, _build)


@_check("DATA-028", "GET_TENSOR of zero bytes answers an empty reply", DA, level=Level.SHOULD, section=C.GET_TENSOR,
        rules=("REPLY-SIZE",))
def get_empty(ctx: Context) -> None:
    buf = session(ctx)
    got = buf.client.get_tensor(buf.tensor(0, 16), 0, 0)
    if got:
        raise fail("GET_TENSOR of 0 bytes returned data", expected="(no bytes)", got=hexdump(got))


@_check("DATA-029", "an ALLOC_BUFFER the device cannot satisfy answers remote_ptr 0 and keeps the connection", DA,
        section=C.ALLOC_BUFFER)
def alloc_too_big(ctx: Context) -> None:
    client = ctx.connect()
    size = 1 << 62
    handle, got = client.alloc_buffer(0, size)
    ctx.note(f"ALLOC_BUFFER of {size} bytes", got=f"handle {handle:#x}, remote_size {got}")
    if handle != 0 or got != 0:
        raise fail("an allocation of 2^62 bytes was not refused in band", expected="remote_ptr 0, remote_size 0",
                   got=f"remote_ptr {handle:#x}, remote_size {got}")
    sent = encode_request(ctx.protocol, C.ALLOC_BUFFER, {"device": 0, "size": size})
    expect_open(ctx, client, sent, "after a refused ALLOC_BUFFER")



#: Sizes tried: below glibc's mmap threshold (heap chunks, reused after a free) and one well above it.
FRESH_SIZES = (256, 4096, 65536)
#: The fill of the buffer freed just before the fresh one is allocated (what a reused chunk would still hold).
FREED_FILL = 0x5A


@_check("DATA-030", "a freshly allocated buffer never hands out another allocation's bytes", DA, level=Level.SHOULD,
        section=C.ALLOC_BUFFER)
def fresh_buffer_clean(ctx: Context) -> str:
    client = ctx.connect()
    leaks: list[tuple[str, LeakReport, bytes]] = []
    for size in FRESH_SIZES:
        # Fill a buffer and free it, so an allocator that reuses the chunk shows it; then read a new one unwritten.
        old = alloc(client, size)
        client.set_tensor(old.tensor(0, size), 0, bytes([FREED_FILL]) * size)
        client.free_buffer(old.handle)
        new = alloc(client, size)
        got = bytes(client.get_tensor(new.tensor(0, size), 0, size))
        report = classify(got, FREED_FILL)
        step = f"GET_TENSOR of a fresh, never-written {size}-byte buffer (after freeing one filled with 5a)"
        ctx.note(step, expected="one value throughout (e.g. zeros)", got=report.describe())
        if report.leaked:
            leaks.append((step, report, got))
        client.free_buffer(new.handle)
    if leaks:
        # Every size is tried: pointer-like words (an address-space leak) are the evidence that matters most.
        step, report, got = max(leaks, key=lambda leak: leak[1].looks_like_addresses)
        where = "addresses" if report.looks_like_addresses else "data"
        raise fail(f"{step}: the server handed out bytes it was never given ({report.symptom}: {where} of other "
                   f"allocations; {len(leaks)} of {len(FRESH_SIZES)} sizes leaked)",
                   expected="one value throughout (e.g. zeros)",
                   got=f"{report.describe()}; first bytes {hexdump(got, 32)}")
    return "fresh buffers read back as one value"
