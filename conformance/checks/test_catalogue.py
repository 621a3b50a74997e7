"""The catalogue as pytest tests: ``pytest --pyargs ggml_rpc.conformance.checks [--rpc-server HOST:PORT]``.

One test per check, in catalogue order, all against the session's server (fixture ``rpc_runner`` from the
``ggml_rpc.conformance.pytest_plugin`` plugin); :func:`judge` turns each check's result into its test's outcome.
"""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.harness import Check, Level, Outcome, Result, Runner
from ggml_rpc.conformance.harness.report_files import evidence_lines


def describe(result: Result) -> str:
    """A failure message: the verdict, the check's link and every piece of evidence."""
    return "\n".join([f"{result.check.id}: {result.message}", f"check: {result.check.title} — {result.spec}",
                      *evidence_lines(result)])


def judge(result: Result, strict: bool) -> None:
    """Turn a check result into the pytest outcome of its test: MUST failures fail, SHOULD failures are expected
    failures unless ``strict``, a check that could not judge is skipped with its reason."""
    if result.outcome is Outcome.PASS:
        return
    if result.outcome in (Outcome.SKIP, Outcome.UNSUPPORTED, Outcome.NOT_RUN):
        pytest.skip(f"{result.outcome.value}: {result.message}")
    if result.failed_level is Level.SHOULD and not strict:
        pytest.xfail("SHOULD check failed: " + describe(result))
    pytest.fail(describe(result), pytrace=False)


@pytest.mark.parametrize("check", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_check(rpc_runner: Runner, check: Check, pytestconfig: pytest.Config) -> None:
    judge(rpc_runner.run_one(check), pytestconfig.getoption("--rpc-strict"))
