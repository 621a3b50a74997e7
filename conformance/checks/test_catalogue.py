"""The catalogue as pytest tests: ``pytest --pyargs ggml_rpc.conformance.checks [--rpc-server HOST:PORT]``.

One test per check, in catalogue order, all against the session's server (fixture ``rpc_runner`` from the
``ggml_rpc.conformance.pytest_plugin`` plugin).
"""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.harness import Check, Runner
from ggml_rpc.conformance.pytest_plugin import judge


@pytest.mark.parametrize("check", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_check(rpc_runner: Runner, check: Check, pytestconfig: pytest.Config) -> None:
    judge(rpc_runner.run_one(check), pytestconfig.getoption("--rpc-strict"))
