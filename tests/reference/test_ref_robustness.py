"""Random and schema-shaped garbage: the server never fails internally and always serves the next connection."""

from __future__ import annotations

import logging

import pytest
from ggml_rpc.reference import running_server
from ggml_rpc.spec import PROTOCOLS, Command, request_parts
from ggml_rpc.spec.strategies import requests
from hypothesis import HealthCheck, given, settings
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
