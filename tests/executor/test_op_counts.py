"""The test-backend-ops counts in OPS.md come from recorded interop runs only, merged op by op."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.upstream import op_counts as counts
from ggml_rpc.conformance.upstream.ops_table import render_ops_table


def interop(commit: str, date: str, rows: list[tuple[str, list[int], list[int]]]) -> dict:
    return {"format": "ggml-rpc-interop/1", "date": date, "commit": commit, "machine": "m",
            "upstream": {"7.0.0": "build"},
            "rows": [{"id": f"OPS-{op}", "status": "pass" if r[0] >= u[0] else "fail",
                      "figures": {"reference": r, "upstream": u}} for op, r, u in rows]
                    + [{"id": "SUITE-7.0.0-upstream", "status": "pass", "figures": {"summary": {}}}]}


def test_record_keeps_the_last_measurement_of_each_op_and_only_the_runs_in_use():
    data, measured = counts.record(counts.empty(), interop("aaa", "d1", [("ADD", [5, 5], [5, 5]),
                                                                        ("SUM", [7, 8], [8, 8])]))
    assert measured == ["ADD", "SUM"]
    data, _ = counts.record(data, interop("bbb", "d2", [("SUM", [8, 8], [8, 8])]))
    assert [r["commit"] for r in data["runs"]] == ["aaa", "bbb"]
    assert data["ops"]["SUM"] == {"reference": [8, 8], "upstream": [8, 8], "status": "pass", "run": 1}
    data, _ = counts.record(data, interop("ccc", "d3", [("ADD", [5, 5], [5, 5])]))
    assert [r["commit"] for r in data["runs"]] == ["bbb", "ccc"]  # run "aaa" no longer backs any op
    assert data["ops"]["SUM"]["run"] == 0 and data["ops"]["ADD"]["run"] == 1


def test_invocations_of_one_commit_are_one_run_spanning_their_dates():
    data, _ = counts.record(counts.empty(), interop("aaa", "d1", [("ADD", [5, 5], [5, 5])]))
    data, _ = counts.record(data, interop("aaa", "d2", [("MUL", [3, 4], [4, 4])]))
    assert data["runs"] == [{"date": "d1 to d2", "commit": "aaa", "machine": "m", "upstream": "build"}]
    assert counts.cell(data, "MUL") == "3/4; 4/4 **short** (run 1)"


def test_the_table_shows_recorded_counts_and_says_when_an_op_was_not_run():
    data, _ = counts.record(counts.empty(), interop("abc1234", "2026-01-01 00:00 UTC", [("SILU", [9, 9], [9, 9])]))
    table = render_ops_table(data)
    assert "commit abc1234" in table and "2026-01-01 00:00 UTC" in table
    row = next(line for line in table.splitlines() if line.startswith("| UNARY/SILU |"))
    assert "9/9; 9/9 (run 1)" in row
    add = next(line for line in table.splitlines() if line.startswith("| ADD |"))
    assert "not run in the recorded runs" in add


def test_record_refuses_what_is_not_an_interop_result():
    with pytest.raises(ValueError, match="interop"):
        counts.record(counts.empty(), {"format": "something-else"})
