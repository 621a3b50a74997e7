"""Per-op closeness records: verdicts, merging runs, and the OPS.md section rendered from them alone."""

from __future__ import annotations

from typing import Any

from ggml_rpc.conformance.upstream import closeness


def _entry(ref: float | None, up: float | None, *, cases: int = 4, deaths: int = 0) -> dict[str, Any]:
    side = lambda w: None if w is None else {"reads": 3, "worst_nmse": w, "mismatches": 0, "deaths": 0}  # noqa: E731
    e = {"cases": cases, "passed": cases, "aborted": False, "reference": side(ref), "upstream": side(up), "run": 0}
    if e["reference"] is not None:
        e["reference"]["deaths"] = deaths
    return e


def test_verdicts_judge_only_where_upstream_is_deterministic() -> None:
    assert closeness.verdict(_entry(0.0, 0.0)) == "met"
    assert closeness.verdict(_entry(1e-12, 0.0)) == "met"
    assert "not met" in closeness.verdict(_entry(2e-9, 0.0))
    assert "not deterministic" in closeness.verdict(_entry(1e-3, 1e-7))
    assert closeness.verdict(_entry(None, None, cases=0)) == "no case on RPC0"
    assert "not compared" in closeness.verdict(_entry(None, 0.0))
    assert "died" in closeness.verdict(_entry(0.0, 0.0, deaths=1))


def _run(ops: dict[str, dict[str, Any]], commit: str) -> dict[str, Any]:
    return {"format": closeness.FORMAT, "runs": [{"date": "d", "commit": commit, "upstream": "u", "machine": "m"}],
            "ops": ops}


def test_a_later_run_replaces_its_ops_and_unused_runs_go() -> None:
    first = closeness.merge(closeness.load(closeness.CLOSENESS_FILE.with_name("no-such-file.json")),
                            _run({"ADD": _entry(0.0, 0.0), "MUL": _entry(1e-12, 0.0)}, "aaa"))
    second = closeness.merge(first, _run({"ADD": _entry(1e-10, 0.0), "MUL": _entry(0.0, 0.0)}, "bbb"))
    assert [r["commit"] for r in second["runs"]] == ["bbb"]
    assert second["ops"]["ADD"]["reference"]["worst_nmse"] == 1e-10 and second["ops"]["ADD"]["run"] == 0
    partial = closeness.merge(first, _run({"ADD": _entry(1e-10, 0.0)}, "ccc"))
    assert [r["commit"] for r in partial["runs"]] == ["aaa", "ccc"]
    assert partial["ops"]["MUL"]["run"] == 0 and partial["ops"]["ADD"]["run"] == 1


def test_the_section_shows_each_recorded_figure() -> None:
    text = "\n".join(closeness.section(_run({"SILU": _entry(1.6e-20, 0.0), "ADD": _entry(0.0, 0.0)}, "abc")))
    assert "commit abc" in text
    assert "| SILU | 4/4 | 3 | 1.6e-20 | 0 (bit for bit) | met |  | 1 |" in text
    assert "| ADD | 4/4 | 3 | 0 (bit for bit) | 0 (bit for bit) | met |  | 1 |" in text
    empty = "\n".join(closeness.section({"format": closeness.FORMAT, "runs": [], "ops": {}}))
    assert "No closeness run is recorded yet" in empty


def test_types_above_the_bar_are_named_worst_first() -> None:
    side = {"by_src0_type": {"F32": {"reads": 5, "worst_nmse": 1e-14}, "Q4_K": {"reads": 3, "worst_nmse": 2e-6},
                             "Q2_K": {"reads": 4, "worst_nmse": 1e-5}}}
    assert closeness.above_bar(side) == "Q2_K 1.0e-05 (4 reads), Q4_K 2.0e-06 (3 reads)"
    assert closeness.above_bar({}) == ""


def test_exact_outputs_and_stopped_replays_are_judged_for_what_they_are() -> None:
    exact = _entry(None, None)
    exact["reference"] = {"reads": 0, "worst_nmse": None, "exact_reads": 7, "exact_differ": 0, "deaths": 0}
    exact["upstream"] = {"reads": 0, "worst_nmse": None, "exact_reads": 7, "exact_differ": 0, "deaths": 0}
    assert closeness.verdict(exact) == "met (exact outputs)"
    exact["reference"]["exact_differ"] = 2
    assert "**not met** (2 of 7 exact outputs differ)" in closeness.verdict(exact)
    stopped = _entry(0.0, 0.0)
    stopped["reference"] = {"error": "the replay took longer than 600 s"}
    assert closeness.verdict(stopped) == "not compared: the replay took longer than 600 s"
    mixed = _entry(1e-12, 0.0)
    mixed["reference"].update(exact_reads=3, exact_differ=1)
    assert "not met" in closeness.verdict(mixed)


def test_invocations_of_one_commit_are_one_run_spanning_their_dates() -> None:
    first = _run({"ADD": _entry(0.0, 0.0)}, "aaa")
    first["runs"][0]["date"] = "2026-12-05 08:00 UTC to 2026-12-05 08:05 UTC"
    second = _run({"MUL": _entry(0.0, 0.0)}, "aaa")
    second["runs"][0]["date"] = "2026-12-05 08:06 UTC to 2026-12-05 08:09 UTC"
    merged = closeness.merge(closeness.merge({"format": closeness.FORMAT, "runs": [], "ops": {}}, first), second)
    assert merged["runs"] == [{"date": "2026-12-05 08:00 UTC to 2026-12-05 08:09 UTC", "commit": "aaa",
                               "upstream": "u", "machine": "m"}]
    assert merged["ops"]["ADD"]["run"] == merged["ops"]["MUL"]["run"] == 0


def test_a_subset_of_cases_is_its_own_row_and_keeps_the_table_whole() -> None:
    key = "FLASH_ATTN_EXT [nb=(1|3),.*type_K=f16]"
    merged = closeness.merge(_run({"FLASH_ATTN_EXT": _entry(None, None, cases=0)}, "aaa"),
                             _run({key: _entry(0.0, 0.0)}, "bbb"))
    assert set(merged["ops"]) == {"FLASH_ATTN_EXT", key}  # the whole op's row stays beside the subset's
    row = next(line for line in closeness.section(merged) if line.startswith("| FLASH_ATTN_EXT ["))
    assert row.startswith(r"| FLASH_ATTN_EXT [nb=(1\|3),.*type_K=f16] | 4/4 |")
    assert row.count(" | ") == 8 - 1  # eight cells: the filter's '|' does not add any


def test_the_case_filter_reaches_test_backend_ops(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from ggml_rpc.conformance.upstream import interpose

    seen: list[list[str]] = []

    def fake_run(argv, **_kw):  # type: ignore[no-untyped-def]
        seen.append(argv)
        return SimpleNamespace(stdout=b"", stderr=b"", returncode=0)

    monkeypatch.setattr(interpose.subprocess, "run", fake_run)
    monkeypatch.setattr(interpose, "backend_ops_env", lambda peer, servers: {})
    peer = SimpleNamespace(test_backend_ops="/x/test-backend-ops")
    interpose.run_backend_ops(peer, "127.0.0.1:1", "FLASH_ATTN_EXT", params="nb=1")  # type: ignore[arg-type]
    interpose.run_backend_ops(peer, "127.0.0.1:1", "ADD")  # type: ignore[arg-type]
    assert seen[0][-4:] == ["-o", "FLASH_ATTN_EXT", "-p", "nb=1"]
    assert "-p" not in seen[1]
