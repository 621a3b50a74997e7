"""The class table of upstream's known memory-safety reports: its data names real checks and strategies, and each
cell says what the peer's check results say (rediscovered, fixed, n/a), never more."""

from __future__ import annotations

import json
from pathlib import Path

from ggml_rpc.conformance.checks import by_id
from ggml_rpc.conformance.fuzz import hunt_strategies
from ggml_rpc.conformance.upstream.known_bugs import CLASSES, KNOWN_BUGS, KnownBug, all_checks
from ggml_rpc.conformance.upstream.security_table import judge, render


def test_every_report_names_real_checks_and_strategies():
    assert {b.cls for b in KNOWN_BUGS} == set(CLASSES)
    assert len({b.key for b in KNOWN_BUGS}) == len(KNOWN_BUGS)
    for bug in KNOWN_BUGS:
        for check_id in bug.checks:
            assert by_id(check_id).id == check_id
        for name in bug.strategies:
            assert callable(getattr(hunt_strategies, name)), name
    assert len(all_checks()) == len(set(all_checks()))


def result(check_id: str, outcome: str, *, death: dict | None = None, message: str = "") -> dict:
    return {"id": check_id, "outcome": outcome, "server_death": death, "message": message}


BUG = KnownBug("A1", "GHSA-x", "data outside its buffer", ("FRAME-010", "FRAME-015"), ("region_edge",))


def test_a_death_is_a_rediscovery_named_by_its_signal_or_sanitizer_class():
    plain = {"FRAME-010": result("FRAME-010", "pass"),
             "FRAME-015": result("FRAME-015", "fail", death={"status": "killed by signal SIGABRT"})}
    assert judge(BUG, plain, {"FRAME-015": True}) == "**rediscovered**: SIGABRT (FRAME-015) (verified)"
    asan = {"FRAME-010": result("FRAME-010", "fail", death={"status": "exited with code 1 after …", "sanitizer": {
        "symptom": "ASan heap-buffer-overflow WRITE in ggml_backend_cpu_buffer_set_tensor"}}),
        "FRAME-015": result("FRAME-015", "fail", death={"status": "killed by signal SIGABRT"})}
    cell = judge(BUG, asan, {})
    assert cell == ("**rediscovered**: ASan heap-buffer-overflow WRITE in ggml_backend_cpu_buffer_set_tensor "
                    "(FRAME-010 +1)")


def test_passes_are_fixed_unsupported_is_not_applicable_and_nothing_is_guessed():
    passes = {c: result(c, "pass") for c in BUG.checks}
    assert judge(BUG, passes, {}) == "fixed (FRAME-010, FRAME-015 pass)"
    assert judge(BUG, {c: result(c, "unsupported") for c in BUG.checks}, {}) == "n/a"
    assert judge(BUG, {}, {}) == "not run"
    assert judge(KnownBug("E9", "r", "w", (), ("get_rows_index",)), passes, {}) == "hunt only"
    g1 = next(b for b in KNOWN_BUGS if b.key == "G1")
    v6 = {"CACHE-V7-002": result("CACHE-V7-002", "unsupported"), "CACHE-V6-001": result("CACHE-V6-001", "pass")}
    assert judge(g1, v6, {}, major=6) == "present by design (CACHE-V6-001 pass)"
    v6["CACHE-V6-001"] = result("CACHE-V6-001", "fail")
    assert not judge(g1, v6, {}, major=6).startswith("present")
    skipped = {"FRAME-010": result("FRAME-010", "pass"), "FRAME-015": result("FRAME-015", "skip")}
    assert judge(BUG, skipped, {}).startswith("inconclusive")


def test_render_names_commit_tree_and_raw_results(tmp_path: Path):
    report = {"results": [result(c, "pass") for c in all_checks()]}
    (tmp_path / "7.0.0.json").write_text(json.dumps(report))
    meta = {"date": "2026-12-04 17:00 UTC", "commit": "abc1234", "dirty": False, "machine": "Linux x86_64"}
    records = [{"peer": "7.0.0", "version": "7.0.0", "report": "7.0.0.json", "verified": {}}]
    hunt = {"peer": "7.0.0+asan-ubsan", "file": "h/findings.json", "seconds": 600.0, "examples": 10, "messages": 99,
            "classes": [{"class": "crash/ASan SEGV READ in f/GRAPH_COMPUTE/-", "kind": "crash",
                         "command": "GRAPH_COMPUTE", "symptom": "ASan SEGV READ in f", "verified": True}]}
    text = render(records, tmp_path, meta, [hunt])
    assert "- commit: abc1234 (clean tree)" in text and f"`{tmp_path.as_posix()}/`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "class" not in line[:8]]
    assert len([r for r in rows if r.split("|")[1].strip()[:2] in {b.key for b in KNOWN_BUGS}]) == len(KNOWN_BUGS)
    assert "| crash/ASan SEGV READ in f/GRAPH_COMPUTE/- | crash | GRAPH_COMPUTE | ASan SEGV READ in f | yes |" in text
