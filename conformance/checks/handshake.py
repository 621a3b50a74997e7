"""Version negotiation: the HELLO exchange, learnt before anything version-dependent is sent."""

from __future__ import annotations

from ggml_rpc.conformance.checks._support import (
    PROBE,
    expect_close,
    fail,
    raw_request,
    recv_upto,
    send_and_expect_close,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.harness import Category, Context, Level, Unsupported, hexdump
from ggml_rpc.spec import CONN_CAPS_SIZE, V6, Command, encode_request
from ggml_rpc.spec.codec import REPLY_HEADER, REPLY_HEADER_SIZE
from ggml_rpc.spec.layout import flat_layout

HS = Category.HANDSHAKE
HELLO_REQUEST = encode_request(V6, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
#: HELLO is the same in every version: its reply layout (and size) come from the v6 table.
_HELLO_REPLY = V6.spec(Command.HELLO).reply
HELLO_REPLY_SIZE = _HELLO_REPLY.header_size
_HELLO_LAYOUT = flat_layout(_HELLO_REPLY.schema)


def _raw_hello(ctx: Context) -> bytes:
    """The complete HELLO reply bytes (header included), read without interpreting them."""
    client = ctx.connect(hello=False)
    client.send_raw(HELLO_REQUEST)
    whole = REPLY_HEADER_SIZE + HELLO_REPLY_SIZE
    got = recv_upto(client.sock, whole, ctx.timeout)
    client.close()  # servers may serve one connection at a time: leave room for the next one
    if len(got) >= REPLY_HEADER_SIZE:
        (size,) = REPLY_HEADER.unpack(got[:REPLY_HEADER_SIZE])
        if size != HELLO_REPLY_SIZE:
            raise fail(f"HELLO reply size header is not {HELLO_REPLY_SIZE}", sent=hexdump(HELLO_REQUEST),
                       expected=hexdump(REPLY_HEADER.pack(HELLO_REPLY_SIZE)), got=hexdump(got))
    if len(got) != whole:
        raise fail("HELLO reply is incomplete", sent=hexdump(HELLO_REQUEST),
                   expected=f"{whole} bytes ({REPLY_HEADER_SIZE} + {HELLO_REPLY_SIZE})", got=hexdump(got))
    return got[REPLY_HEADER_SIZE:]


@_check("HELLO-001", "HELLO is answered with a 28-byte reply (size header 28)", HS, section=Command.HELLO,
        any_version=True, rules=("REPLY-SIZE",))
def hello_reply_size(ctx: Context) -> str:
    body = _raw_hello(ctx)
    ctx.note("HELLO reply", sent=hexdump(HELLO_REQUEST), got=hexdump(body))
    return f"server {ctx.info.verdict}"


@_check("HELLO-002", "HELLO announces a protocol version this kit covers (and the one asked for)", HS,
        section=Command.HELLO, any_version=True)
def hello_version(ctx: Context) -> str:
    body = _raw_hello(ctx)
    fields = _HELLO_LAYOUT.unpack(body)
    version = (fields["major"], fields["minor"], fields["patch"])
    label = ".".join(map(str, version))
    want = ctx.expect
    ctx.note("version", got=f"{label} ({ctx.info.verdict})")
    if want is not None and version[:2] != want.version[:2]:
        raise fail(f"server announces {label}, the run asked for {want.label}",
                   expected=f"major.minor {want.version[0]}.{want.version[1]}", got=hexdump(body[:4]))
    if not ctx.info.covered:
        raise Unsupported(f"server announces {label}: {ctx.info.verdict.removeprefix('speaks ')}")
    return ctx.info.verdict


@_check("HELLO-003", "HELLO reply pad byte is 0", HS, section=Command.HELLO, any_version=True)
def hello_pad(ctx: Context) -> None:
    pad = _HELLO_LAYOUT.unpack(_raw_hello(ctx))["pad"]
    if pad != 0:
        raise fail("pad byte of the HELLO reply is not 0", expected="00", got=f"{pad:02x}", sent=hexdump(HELLO_REQUEST))


@_check("HELLO-004", "HELLO reply caps are all zero over plain TCP (keeps the client on TCP)", HS, level=Level.SHOULD,
        section=Command.HELLO, any_version=True)
def hello_caps(ctx: Context) -> None:
    caps = _HELLO_LAYOUT.unpack(_raw_hello(ctx))["conn_caps"]
    if any(caps):
        raise fail("conn_caps of the HELLO reply are not all zero although the client sent zero caps",
                   expected=f"{CONN_CAPS_SIZE} zero bytes", got=hexdump(caps))


@_check("HELLO-005", "every connection announces the same version", HS, section=Command.HELLO, any_version=True)
def hello_stable(ctx: Context) -> None:
    seen = [_raw_hello(ctx)[:4] for _ in range(3)]
    ctx.close_all()
    if len(set(seen)) != 1:
        raise fail("the version differs between connections", got=", ".join(hexdump(s) for s in seen))


@_check("HELLO-006", "a first command other than HELLO closes the connection without reply", HS,
        section=Command.HELLO, rules=("DECODE",), bad_input=True)
def first_not_hello(ctx: Context) -> None:
    client = ctx.connect(hello=False)
    client.send_raw(PROBE)
    expect_close(ctx, client, PROBE, "DEVICE_COUNT before HELLO", probe=False)


@_check("HELLO-007", "HELLO with a size other than 24 closes the connection", HS, section=Command.HELLO,
        rules=("DECODE",), bad_input=True)
def hello_bad_size(ctx: Context) -> None:
    for size in (0, 28):
        client = ctx.connect(hello=False)
        sent = raw_request(Command.HELLO, bytes(size))
        send_and_expect_close(ctx, client, sent, f"HELLO with size {size}")
        client.close()


@_check("HELLO-008", "a second HELLO on the same connection closes it", HS, section=Command.HELLO,
        rules=("DECODE",), bad_input=True)
def hello_twice(ctx: Context) -> None:
    client = ctx.connect()
    send_and_expect_close(ctx, client, HELLO_REQUEST, "second HELLO")


@_check("HELLO-009", "DEVICE_COUNT answers at least one device", HS, section=Command.DEVICE_COUNT)
def device_count(ctx: Context) -> str:
    n = ctx.connect().device_count()
    if n < 1:
        raise fail("DEVICE_COUNT is 0: no device index is usable", expected=">= 1", got=str(n))
    return f"{n} device(s)"
