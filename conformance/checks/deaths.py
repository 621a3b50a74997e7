"""Framing: what upstream 6.0/7.0 was seen to die of — size headers of 2^63 and more, a deep src
chain, a client that leaves before its reply, a SET_TENSOR of the other version's layout.  The server must refuse
or survive, never die: each is a SHOULD check whose breaker dies as upstream does.
"""

from __future__ import annotations

import struct

import numpy as np
from ggml_rpc.conformance.checks._support import (
    PROBE,
    PROBE_REPLY_SIZE,
    expect_close,
    fail,
    raw_request,
    recv_upto,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.framing import FR, get_tensor_request, set_tensor_request
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.harness import Context, Level, hexdump
from ggml_rpc.spec import V6, V7, GgmlType, encode_request
from ggml_rpc.spec import Command as C
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER_SIZE, TENSOR_DTYPE

#: The smallest size header no container can hold (upstream: an uncaught length error, SIGABRT).
HUGE_SIZES = (1 << 63, (1 << 64) - 1)


def _claim(ctx: Context, cmd: C, head: bytes, size: int, step: str) -> None:
    """A fresh connection sends ``head`` under a header claiming ``size`` payload bytes: it must be closed."""
    client = ctx.connect()
    sent = raw_request(cmd, head, size=size)
    client.send_raw(sent)
    expect_close(ctx, client, sent, step, probe=False)
    client.close()


@_check("FRAME-036", "a SET_TENSOR size header of 2^63 or more closes the connection (the server survives)", FR,
        level=Level.SHOULD, section=C.SET_TENSOR, rules=("REGION-PAST-TENSOR",))
def set_tensor_claim_2_63(ctx: Context) -> None:
    for size in HUGE_SIZES:
        buf = session(ctx)
        head = set_tensor_request(ctx, buf.tensor(0, 16), 0, b"")[REQUEST_HEADER_SIZE:]
        sent = raw_request(C.SET_TENSOR, head, size=size)
        buf.client.send_raw(sent)
        expect_close(ctx, buf.client, sent, f"SET_TENSOR header claiming {size:#x} payload bytes", probe=False)
        buf.client.close()


@_check("FRAME-037", "a GRAPH_COMPUTE size header of 2^63 or more closes the connection (the server survives)", FR,
        level=Level.SHOULD, section=C.GRAPH_COMPUTE, rules=("DECODE",))
def graph_claim_2_63(ctx: Context) -> None:
    for size in HUGE_SIZES:
        # A plausible start (device 0, one node) so that only the size is wrong.
        _claim(ctx, C.GRAPH_COMPUTE, struct.pack("<II", 0, 1), size,
               f"GRAPH_COMPUTE header claiming {size:#x} payload bytes")


#: Upstream's recursive graph rebuild overflows its stack here (6.0.0 and 7.0.0: 100,000 computes, 300,000 dies).
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


def expect_open_or_closed(ctx: Context, client: RpcClient, sent: bytes, step: str) -> str:
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
            raise fail(f"{step}: neither an answer to the next command nor a close within {ctx.timeout:g} s",
                       sent=short, expected="the next command answered, or the connection closed",
                       got="connection open, silent")
        ctx.note(step, sent=short, expected="processed or closed", got="closed, no reply bytes")
        return "refused"
    if len(got) != len(want) + PROBE_REPLY_SIZE or got[: len(want)] != want:
        raise fail(f"{step}: bytes arrived that answer no command", sent=short,
                   expected=f"only the DEVICE_COUNT reply: {hexdump(want)} + {PROBE_REPLY_SIZE} bytes",
                   got=hexdump(got))
    ctx.note(step, sent=short, expected="processed or closed", got="processed, connection open")
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
    ctx.note(f"{what}, then close before the reply is read (the request's last bytes go with the FIN)",
             sent=hexdump(sent, 48))
    client.leave(sent)
    # A server serving one connection at a time takes this one only once it is done with the closed one, so a
    # server that dies writing its reply is found dead here, in this step.
    after = ctx.connect()
    after.device_count()
    after.close()


@_check("FRAME-039", "a client that closes before reading its reply does not take the server down", FR,
        level=Level.SHOULD, section="framing")
def close_before_reply(ctx: Context) -> None:
    # The request's last bytes travel with the client's FIN (cork), so the server's first reply write always meets
    # a closed peer; each way of leaving is still tried a few times (the reset must be in before the second write).
    for round_ in range(1, CLOSE_ROUNDS + 1):
        # HELLO first: its reply goes out as two writes upstream (size, then body).
        hello = raw_request(C.HELLO, bytes(ctx.protocol.spec(C.HELLO).request.header_size))
        ctx.note(f"HELLO, then close before the reply is read (round {round_})", sent=hexdump(hello))
        ctx.connect(hello=False).leave(hello)
        after = ctx.connect()
        after.device_count()
        after.close()
        buf = session(ctx, 1 << 20)
        _close_unread(ctx, buf.client, get_tensor_request(ctx, buf.tensor(0, buf.size), 0, buf.size),
                      f"GET_TENSOR of 1 MiB (round {round_})")
        for cmd, fields in ((C.GET_ALIGNMENT, {"device": 0}), (C.DEVICE_COUNT, {})):
            _close_unread(ctx, ctx.connect(), encode_request(ctx.protocol, cmd, fields),
                          f"{cmd.name} (round {round_})")


@_check("FRAME-040", "a SET_TENSOR in the other major's layout (cache_flag byte present or missing) is refused", FR,
        section=C.SET_TENSOR, rules=("FRAMING-OTHER-LAYOUT",))
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
