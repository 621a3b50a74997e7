"""Random and schema-shaped garbage: the server never fails internally and always serves the next connection."""

from __future__ import annotations

import logging

import pytest
from ggml_rpc.reference import running_server
from ggml_rpc.spec import PROTOCOLS, Command, request_parts
from ggml_rpc.spec.strategies import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from refhelpers import assert_served, connect

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=[p.label for p in PROTOCOLS])
def watched(request):
    handler = Collect()
    logger = logging.getLogger("ggml_rpc.reference")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with running_server(request.param, mem=64 << 20) as srv:
            yield srv, handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _no_internal_errors(handler: Collect) -> None:
    bad = [ln for ln in handler.lines if "internal error" in ln or "unexpected error" in ln]
    assert not bad, bad


@SETTINGS
@given(data=st.data())
def test_schema_shaped_requests_never_break_the_server(watched, data) -> None:
    srv, handler = watched
    protocol = srv.protocol
    msgs = data.draw(st.lists(requests(protocol, max_count=3, max_data=256), min_size=1, max_size=4))
    with connect(srv) as c:
        for m in msgs:
            if m.command is Command.HELLO:
                continue
            try:
                c.send_raw(request_parts(protocol, m.command, m.fields, m.data))
            except Exception:
                break  # the server already closed: fine
    assert_served(srv)
    _no_internal_errors(handler)


@SETTINGS
@given(cmd=st.integers(0, 255), size=st.integers(0, 2**64 - 1), body=st.binary(max_size=512))
def test_raw_garbage_never_breaks_the_server(watched, cmd, size, body) -> None:
    srv, handler = watched
    with connect(srv) as c:
        try:
            c.send_raw(bytes([cmd]) + size.to_bytes(8, "little") + body)
        except Exception:
            pass
    assert_served(srv)
    _no_internal_errors(handler)


@pytest.fixture(scope="module")
def plain_srv():
    with running_server("7") as srv:
        yield srv


@settings(SETTINGS, max_examples=80)
@given(
    ne0=st.integers(0, 80),
    d_off=st.one_of(st.integers(0, 64).map(lambda k: 4 * k), st.integers(-8, 270)),
    offset=st.one_of(st.integers(0, 64), st.integers(0, 300), st.just(2**64 - 4)),
    n=st.one_of(st.integers(0, 32), st.integers(0, 300)),
)
def test_set_tensor_bounds_match_the_spec_oracle(plain_srv, ne0, d_off, offset, n) -> None:
    """SET_TENSOR near the edges of a 256-byte buffer: accepted exactly when the region rules say so
    (spec/PROTOCOL.md#rules)."""
    from ggml_rpc.spec import make_tensor

    size = 256
    with connect(plain_srv) as c:
        handle, _ = c.alloc_buffer(0, size)
        base = c.buffer_get_base(handle)
        whole = make_tensor(id=9, ne=(size,), type=24, buffer=handle, data=base)  # I8 over the whole buffer
        d = base + d_off
        t = make_tensor(id=1, ne=(ne0,), buffer=handle, data=d)
        nbytes = 4 * ne0 if ne0 else 0
        start = (d + offset) % 2**64
        accepted = (
            base <= d and d + nbytes <= base + size  # deserialize_tensor's buffer-range check
            and base <= start < base + size and n <= base + size - start  # SET_TENSOR's region check
            and not (n and offset + n > nbytes)  # the backend's tensor bounds (an abort upstream)
        )
        event("accepted" if accepted else "closed")
        payload = bytes((i * 7 + 1) % 251 + 1 for i in range(n))
        c.set_tensor(t, offset, payload)
        if not accepted:
            assert c.expect_closed(10)
            return
        expected = bytearray(size)
        expected[start - base : start - base + n] = payload
        assert bytes(c.get_tensor(whole, 0, size)) == bytes(expected)
