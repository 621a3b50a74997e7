"""Running a hunt in a test: the embedded target started and always stopped, and what a clean run must show."""

from __future__ import annotations

from ggml_rpc.conformance.fuzz.hunt import Hunt


def run_clean(hunt: Hunt) -> None:
    """Run ``hunt`` against its (embedded) target; it must end with no finding, no restart and no fuzzer error."""
    hunt.target.start()
    try:
        hunt.run()
    finally:
        hunt.target.stop()
    assert [f.line() for f in hunt.findings] == []
    assert hunt.stats.restarts == 0 and hunt.hunt.fuzzer_errors == 0
