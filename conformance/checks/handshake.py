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
from ggml_rpc.spec.codec import REPLY_HEADER

HS = Category.HANDSHAKE
HELLO_REQUEST = encode_request(V6, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})
HELLO_REPLY_SIZE = 28


def _raw_hello(ctx: Context) -> bytes:
    """The complete HELLO reply bytes (header included), read without interpreting them."""
    client = ctx.connect(hello=False)
    client.send_raw(HELLO_REQUEST)
    got = recv_upto(client.sock, 8 + HELLO_REPLY_SIZE, ctx.timeout)
    client.close()  # servers may serve one connection at a time: leave room for the next one
    if len(got) >= 8:
        (size,) = REPLY_HEADER.unpack(got[:8])
        if size != HELLO_REPLY_SIZE:
            raise fail("HELLO reply size header is not 28", sent=hexdump(HELLO_REQUEST),
                       expected=hexdump(REPLY_HEADER.pack(HELLO_REPLY_SIZE)), got=hexdump(got))
    if len(got) != 8 + HELLO_REPLY_SIZE:
        raise fail("HELLO reply is incomplete", sent=hexdump(HELLO_REQUEST), expected="36 bytes (8 + 28)",
                   got=hexdump(got))
    return got[8:]


@_check("HELLO-001", "HELLO is answered with a 28-byte reply (size header 28)", HS, section=Command.HELLO,
        any_version=True)
def hello_reply_size(ctx: Context) -> str:
    body = _raw_hello(ctx)
    ctx.note("HELLO reply", sent=hexdump(HELLO_REQUEST), got=hexdump(body))
    return f"server {ctx.info.verdict}"


@_check("HELLO-002", "HELLO announces a protocol version this kit covers (and the one asked for)", HS,
        section=Command.HELLO, any_version=True)
def hello_version(ctx: Context) -> str:
    body = _raw_hello(ctx)
    version = (body[0], body[1], body[2])
    label = ".".join(map(str, version))
    want = ctx.runner.expect
    ctx.note("version", got=f"{label} ({ctx.info.verdict})")
    if want is not None and version[:2] != want.version[:2]:
        raise fail(f"server announces {label}, the run asked for {want.label}",
                   expected=f"major.minor {want.version[0]}.{want.version[1]}", got=hexdump(body[:4]))
    if not ctx.info.covered:
        raise Unsupported(f"server announces {label}: {ctx.info.verdict.removeprefix('speaks ')}")
    return ctx.info.verdict


@_check("HELLO-003", "HELLO reply pad byte is 0", HS, section=Command.HELLO, any_version=True)
def hello_pad(ctx: Context) -> None:
    body = _raw_hello(ctx)
    if body[3] != 0:
        raise fail("pad byte (offset 3 of the HELLO reply) is not 0", expected="00", got=f"{body[3]:02x}",
                   sent=hexdump(HELLO_REQUEST))


@_check("HELLO-004", "HELLO reply caps are all zero over plain TCP (keeps the client on TCP)", HS, level=Level.SHOULD,
        section=Command.HELLO, any_version=True)
def hello_caps(ctx: Context) -> None:
    body = _raw_hello(ctx)
    if any(body[4:]):
        raise fail("conn_caps of the HELLO reply are not all zero although the client sent zero caps",
                   expected="24 zero bytes", got=hexdump(body[4:]))


@_check("HELLO-005", "every connection announces the same version", HS, section=Command.HELLO, any_version=True)
def hello_stable(ctx: Context) -> None:
    seen = [_raw_hello(ctx)[:4] for _ in range(3)]
    ctx.close_all()
    if len(set(seen)) != 1:
        raise fail("the version differs between connections", got=", ".join(hexdump(s) for s in seen))


@_check("HELLO-006", "a first command other than HELLO closes the connection without reply", HS,
        section=Command.HELLO, survive=Level.SHOULD)
def first_not_hello(ctx: Context) -> None:
    client = ctx.connect(hello=False)
    client.send_raw(PROBE)
    expect_close(ctx, client, PROBE, "DEVICE_COUNT before HELLO", probe=False)


@_check("HELLO-007", "HELLO with a size other than 24 closes the connection", HS, section=Command.HELLO,
        survive=Level.SHOULD)
def hello_bad_size(ctx: Context) -> None:
    for size in (0, 28):
        client = ctx.connect(hello=False)
        sent = raw_request(Command.HELLO, bytes(size))
        send_and_expect_close(ctx, client, sent, f"HELLO with size {size}")
        client.close()


@_check("HELLO-008", "a second HELLO on the same connection closes it", HS, section=Command.HELLO,
        survive=Level.SHOULD)
def hello_twice(ctx: Context) -> None:
    client = ctx.connect()
    send_and_expect_close(ctx, client, HELLO_REQUEST, "second HELLO")


@_check("HELLO-009", "DEVICE_COUNT answers at least one device", HS, section=Command.DEVICE_COUNT)
def device_count(ctx: Context) -> str:
    n = ctx.connect().device_count()
    if n < 1:
        raise fail("DEVICE_COUNT is 0: no device index is usable", expected=">= 1", got=str(n))
    return f"{n} device(s)"
