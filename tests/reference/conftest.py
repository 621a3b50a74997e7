"""Fixtures: one reference server per protocol version, shared by a module's tests (connections never overlap)."""

from __future__ import annotations

import pytest
from ggml_rpc.reference import running_server


@pytest.fixture(scope="module", params=["6", "7", "8"])
def srv(request):
    with running_server(request.param) as s:
        yield s


@pytest.fixture(scope="module")
def srv701():
    with running_server("7.0.1") as s:
        yield s
