"""8.0.0's two-dimensional transfers: SET_TENSOR_2D and GET_TENSOR_2D move rows stride apart, and refuse regions
that do not fit (the checks upstream added with the commands, and the overflow a review flagged)."""

from __future__ import annotations

from ggml_rpc.conformance.checks._support import (
    Buf,
    expect_bytes,
    expect_silence_then_reply,
    nonce,
    read_back,
    send_and_expect_close,
    session,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.harness import Category, Context
from ggml_rpc.spec import Command as C
from ggml_rpc.spec import encode_request

V8_ONLY = (8,)
SIZE, ROWS, STRIDE, OFFSET = 24, 5, 40, 8  # rows with gaps between them, not starting at the tensor's first byte


def _rows(buf: Buf, *, size: int = SIZE, n_copies: int = ROWS, stride: int = STRIDE, offset: int = OFFSET,
          data: bytes | None = None) -> bytes:
    """A SET_TENSOR_2D request into the whole buffer (data: ``size * n_copies`` fresh bytes by default)."""
    fields = {"tensor": buf.tensor(0, buf.size), "offset": offset, "size": size, "n_copies": n_copies,
              "stride": stride}
    return encode_request(buf.client.protocol, C.SET_TENSOR_2D, fields, nonce(size * n_copies) if data is None
                          else data)


def _get_rows(buf: Buf, *, size: int = SIZE, n_copies: int = ROWS, stride: int = STRIDE,
              offset: int = OFFSET) -> bytes:
    fields = {"tensor": buf.tensor(0, buf.size), "offset": offset, "size": size, "n_copies": n_copies,
              "stride": stride}
    return encode_request(buf.client.protocol, C.GET_TENSOR_2D, fields)


@_check("DATA-031", "SET_TENSOR_2D writes each row stride apart and nothing between the rows", Category.DATA,
        majors=V8_ONLY, section=C.SET_TENSOR_2D)
def set_rows(ctx: Context) -> None:
    buf = session(ctx, 4096)
    before = nonce(buf.size)
    buf.client.set_tensor(buf.tensor(0, buf.size), 0, before)
    rows = nonce(SIZE * ROWS)
    sent = _rows(buf, data=rows)
    buf.client.send_raw(sent)
    expect_silence_then_reply(ctx, buf.client, sent, "SET_TENSOR_2D")
    want = bytearray(before)
    for i in range(ROWS):
        at = OFFSET + i * STRIDE
        want[at : at + SIZE] = rows[i * SIZE : (i + 1) * SIZE]
    ctx.note("SET_TENSOR_2D", sent=f"{ROWS} rows x {SIZE} bytes, stride {STRIDE}, offset {OFFSET}")
    expect_bytes("read back after SET_TENSOR_2D", read_back(buf, 0, buf.size), bytes(want))


@_check("DATA-032", "GET_TENSOR_2D returns the rows packed: exactly size x n_copies bytes", Category.DATA,
        majors=V8_ONLY, section=C.GET_TENSOR_2D)
def get_rows(ctx: Context) -> None:
    buf = session(ctx, 4096)
    content = nonce(buf.size)
    buf.client.set_tensor(buf.tensor(0, buf.size), 0, content)
    got = buf.client.get_tensor_2d(buf.tensor(0, buf.size), OFFSET, SIZE, ROWS, STRIDE)
    want = b"".join(content[OFFSET + i * STRIDE : OFFSET + i * STRIDE + SIZE] for i in range(ROWS))
    ctx.note("GET_TENSOR_2D", sent=f"{ROWS} rows x {SIZE} bytes, stride {STRIDE}", got=f"{len(got)} bytes")
    expect_bytes("GET_TENSOR_2D", got, want)


@_check("FRAME-041", "SET_TENSOR_2D whose data is not exactly size x n_copies bytes closes the connection",
        Category.FRAMING, majors=V8_ONLY, section=C.SET_TENSOR_2D, rules=("ROWS-DATA-LENGTH",))
def set_rows_wrong_length(ctx: Context) -> None:
    buf = session(ctx, 4096)
    send_and_expect_close(ctx, buf.client, _rows(buf, data=nonce(SIZE * ROWS - 1)),
                          f"SET_TENSOR_2D of {ROWS} x {SIZE} rows carrying {SIZE * ROWS - 1} bytes")


@_check("FRAME-042", "SET/GET_TENSOR_2D with size 0 or n_copies 0 closes the connection", Category.FRAMING,
        majors=V8_ONLY, section=C.GET_TENSOR_2D, rules=("ROWS-ZERO",))
def rows_zero_counts(ctx: Context) -> None:
    buf = session(ctx, 4096)
    send_and_expect_close(ctx, buf.client, _get_rows(buf, n_copies=0), "GET_TENSOR_2D of 0 rows")
    buf = session(ctx, 4096)
    send_and_expect_close(ctx, buf.client, _get_rows(buf, size=0), "GET_TENSOR_2D of 0-byte rows")
    buf = session(ctx, 4096)
    send_and_expect_close(ctx, buf.client, _rows(buf, size=0, data=b""), "SET_TENSOR_2D of 0-byte rows")


@_check("FRAME-043", "SET/GET_TENSOR_2D rows running past the tensor close the connection (nothing is read or "
        "written)", Category.FRAMING, majors=V8_ONLY, section=C.GET_TENSOR_2D, rules=("ROWS-PAST-TENSOR",))
def rows_past_tensor(ctx: Context) -> None:
    buf = session(ctx, 4096)
    rows = buf.size // STRIDE + 1  # the last row starts past the end
    send_and_expect_close(ctx, buf.client, _get_rows(buf, n_copies=rows),
                          f"GET_TENSOR_2D of {rows} rows, stride {STRIDE}, in {buf.size} bytes")
    buf = session(ctx, 4096)
    send_and_expect_close(ctx, buf.client, _rows(buf, n_copies=rows),
                          f"SET_TENSOR_2D of {rows} rows, stride {STRIDE}, in {buf.size} bytes")


@_check("FRAME-044", "2-D rows whose span overflows 64 bits close the connection (size x n_copies and stride "
        "arithmetic)", Category.FRAMING, majors=V8_ONLY, section=C.GET_TENSOR_2D,
        rules=("ROWS-DATA-LENGTH", "ROWS-SPAN-OVERFLOW"))
def rows_overflow(ctx: Context) -> None:
    buf = session(ctx, 4096)
    # (n_copies - 1) * stride wraps to a small span: a server computing it in 64 bits would read inside the buffer.
    stride = (1 << 64) // 2 + STRIDE // 2
    sent = _get_rows(buf, n_copies=3, stride=stride)
    send_and_expect_close(ctx, buf.client, sent, f"GET_TENSOR_2D of 3 rows, stride {stride:#x}")
    buf = session(ctx, 4096)
    # size * n_copies wraps to 0: the payload carries no data at all.
    sent = _rows(buf, size=1 << 32, n_copies=1 << 32, data=b"")
    send_and_expect_close(ctx, buf.client, sent, "SET_TENSOR_2D of 2^32 rows x 2^32 bytes with no data")
