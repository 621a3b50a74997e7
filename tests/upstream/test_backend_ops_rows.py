"""OPS rows compare test-backend-ops cases by name, not pass counts (no upstream peer needed: parsed output).

A row passed when the reference's pass count was at least upstream's: one case lost and another gained gave equal
counts and a PASS.  Now the cases upstream's server passes must each pass through the reference, by name.
"""

from __future__ import annotations

from ggml_rpc.conformance.upstream.backend_ops_rows import compare_cases, judge
from ggml_rpc.conformance.upstream.cells import FAIL, PASS, UNSUPPORTED
from ggml_rpc.conformance.upstream.interpose import BackendOpsResult, parse_backend_ops

A = "ADD(type=f32,ne=[1,1,8,1],nr=[1,1,1,1],nf=1)"
B = "ADD(type=f32,ne=[16,10,1,1],nr=[1,1,1,1],nf=1)"
C = "ADD(type=f16,ne=[16,10,1,1],nr=[1,1,1,1],nf=1)"


def run(cases: dict[str, str], *, exit_code: int = 0) -> BackendOpsResult:
    """A finished run printing ``cases`` (name -> "OK" / "FAIL" / "not supported [RPC0]"), colours and all."""
    colour = {"OK": "\x1b[1;32mOK\x1b[0m", "FAIL": "\x1b[1;31mFAIL\x1b[0m"}
    lines = [f"  {name}: {colour.get(out, out)}" for name, out in cases.items()]
    passed = sum(out == "OK" for out in cases.values())
    run = sum(out in ("OK", "FAIL") for out in cases.values())
    r = parse_backend_ops("\n".join([*lines, f"  {passed}/{run} tests passed", ""]))
    r.exit_code = exit_code
    return r


def test_the_same_count_of_other_cases_fails_the_row_and_names_them():
    upstream = run({A: "OK", B: "OK", C: "FAIL"})
    reference = run({A: "OK", B: "FAIL", C: "OK"})  # 2 passes each: the count alone said PASS
    cell = judge("ADD", reference, upstream)
    assert cell.status == FAIL
    assert cell.figures["only_upstream_passes"] == [B]
    assert cell.figures["only_reference_passes"] == [C]
    assert f"1 case(s) pass only upstream, first: {B}" in cell.detail


def test_every_upstream_case_passing_through_the_reference_passes():
    upstream = run({A: "OK", B: "FAIL", C: "not supported [RPC0]"})
    reference = run({A: "OK", B: "OK", C: "OK"})
    cell = judge("ADD", reference, upstream)
    assert cell.status == PASS
    assert cell.figures["only_upstream_passes"] == [] and cell.figures["only_reference_passes"] == sorted([B, C])


def test_a_case_the_reference_never_ran_is_lost():
    assert compare_cases(run({A: "OK"}), run({A: "OK", B: "OK"}), "ADD").lost == [B]


def test_an_aborted_reference_run_fails_even_with_every_case_passed():
    cell = judge("ADD", run({A: "OK"}, exit_code=-6), run({A: "OK"}))
    assert cell.status == FAIL


def test_cases_of_other_ops_are_not_compared():
    other = "MUL(type=f32,ne=[4,1,1,1],nr=[1,1,1,1],nf=1)"
    assert compare_cases(run({A: "OK"}), run({A: "OK", other: "OK"}), "ADD").lost == []


def test_an_op_upstream_does_not_test_is_unsupported():
    assert judge("ADD", run({}), run({})).status == UNSUPPORTED
