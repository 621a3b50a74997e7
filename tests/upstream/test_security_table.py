"""The class table of upstream's known memory-safety reports: its data names real checks and strategies, and each
cell says what the peer's check results say (rediscovered, fixed, n/a), never more."""

from __future__ import annotations

import json
from pathlib import Path

from ggml_rpc.conformance.checks import by_id
from ggml_rpc.conformance.checks.shadow import SHADOW_CHECKS
from ggml_rpc.conformance.fuzz import hunt_strategies
from ggml_rpc.conformance.upstream.known_bugs import (
    CLASSES,
    KNOWN_BUGS,
    NEW_BUGS,
    KnownBug,
    all_checks,
    explained_by,
    explained_checks,
)
from ggml_rpc.conformance.upstream.security_table import judge, keep_hunt_reproducers, render, statement


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


def test_a_hunt_class_is_explained_by_its_flaw_and_a_write_only_explains_a_corruption():
    def found(rule: str, kind: str = "crash", command: str = "SET_TENSOR", broken: str = "") -> dict:
        return {"rule": rule, "kind": kind, "command": command, "broken": broken or f"{rule} = 1"}

    assert explained_by(found("bound: tensor.data")).key == "A1"
    assert explained_by(found("kernel: SET_ROWS.rows", "corruption", "GRAPH_COMPUTE")).key == "E5"
    # A read's bug explains no write outside a request's destination; nothing explains a valid request's failure,
    # a client leaving early, or a corruption through a flaw whose report is not about a write.
    assert explained_by(found("kernel: GET_ROWS.rows", "corruption", "GRAPH_COMPUTE")) is None
    assert explained_by(found("bound: tensor.data", "corruption")) is None
    assert explained_by(found("valid")) is None
    assert explained_by(found("early-close: before the reply")) is None
    # A tensor of zero elements is the kit-found bug's (on COPY_TENSOR), no report's.
    zero = "bound: dst.data = 0x10 (zero elements, below)"
    assert explained_by(found("bound: dst.data", "corruption", "COPY_TENSOR", zero)).key == "N1"
    assert explained_by(found("bound: dst.data", "crash", "COPY_TENSOR", zero)).key == "N1"
    assert explained_by(found("bound: tensor.data", "crash", "SET_TENSOR", zero.replace("dst", "tensor"))) is None


def test_every_kit_found_bug_states_its_checks_and_reproducers():
    keys = [b.key for b in NEW_BUGS]
    assert keys and len(set(keys)) == len(keys) and all(k.startswith("N") for k in keys)
    root = Path(__file__).resolve().parents[2]
    for bug in NEW_BUGS:
        assert bug.what and bug.checks and bug.reproducers and bug.writes
        for check_id in bug.checks:
            assert by_id(check_id).id == check_id and check_id in explained_checks()
        for name in bug.strategies:
            assert callable(getattr(hunt_strategies, name)), name
        assert all((root / r).is_file() for r in bug.reproducers)
    # Every shadow check is measured on every build; the interop matrix excuses only the stated ones.
    assert {c.id for c in SHADOW_CHECKS} <= set(all_checks())
    assert not {c.id for c in SHADOW_CHECKS} - {c for b in NEW_BUGS for c in b.checks} & set(explained_checks())


def test_the_new_section_measures_each_kit_found_bug_and_lists_what_no_report_explains(tmp_path: Path):
    results = [result(c, "pass") for c in all_checks()]
    results = [result("SHADOW-011", "fail", message="COPY_TENSOR wrote 16 bytes into buffer 2 at [0, 16)")
               if r["id"] == "SHADOW-011" else r for r in results]
    died = {"status": "killed by signal SIGABRT", "log_tail": [
        "/tmp/b/ggml/src/ggml-rpc/ggml-rpc.cpp:1416: GGML_ASSERT(tensor->data >= buffer_start) failed"]}
    results = [result("SHADOW-003", "fail", death=died) if r["id"] == "SHADOW-003" else r for r in results]
    (tmp_path / "8.0.0.json").write_text(json.dumps({"results": results}))
    meta = {"date": "2026-12-07 13:00 UTC", "commit": "abc1234", "dirty": False, "machine": "Linux x86_64"}
    records = [{"peer": "8.0.0", "version": "8.0.0", "report": "8.0.0.json", "verified": {}}]
    new = {"class": "corruption/-/MEMSET_TENSOR/valid", "kind": "corruption", "command": "MEMSET_TENSOR",
           "symptom": "", "rule": "valid", "broken": None, "verified": True, "reproducer": None,
           "message": "MEMSET_TENSOR changed 4 bytes of buffer 3"}
    old = {"class": "crash/SIGABRT/SET_TENSOR/bound: tensor.data", "kind": "crash", "command": "SET_TENSOR",
           "symptom": "SIGABRT", "rule": "bound: tensor.data", "broken": "bound: tensor.data = 0x1", "verified": True}
    hunt = {"peer": "8.0.0", "file": "h/findings.json", "seconds": 600.0, "examples": 10, "messages": 99,
            "classes": [new, old]}
    text = render(records, tmp_path, meta, [hunt])
    section = text.split("## Found by the kit", 1)[1]
    n1 = next(line for line in section.splitlines() if line.startswith("| N1 |"))
    assert n1.endswith("| **present**: fails: COPY_TENSOR wrote 16 bytes into buffer 2 at [0, 16) (SHADOW-011) |")
    assert "| SHADOW-011 |" in section and "**fails**: COPY_TENSOR wrote 16 bytes" in section
    assert "| **dies**: killed by signal SIGABRT at ggml-rpc.cpp:1416 |" in section
    assert sum(line.startswith("| SHADOW-0") for line in section.splitlines()) == len(SHADOW_CHECKS)
    listed = section.split("that no report explains", 1)[1]
    assert "corruption/-/MEMSET_TENSOR/valid" in listed and "bound: tensor.data" not in listed.split("##")[0]
    assert "a MEMSET_TENSOR the reference accepts writes outside what it names" in listed
    assert "| not kept: no reproducer |" in listed
    assert "| crash/SIGABRT/SET_TENSOR/bound: tensor.data | crash | SET_TENSOR | SIGABRT | yes | A1 |" in text
    early = {"command": "GET_MAX_SIZE", "broken": "early-close: before the reply", "rule": "early-close: before the "
             "reply", "kind": "crash", "symptom": "SIGPIPE"}
    assert statement(early) == "a GET_MAX_SIZE whose client closes before the reply kills the server (SIGPIPE)"
    bound = {**early, "broken": "bound: tensor.ne.3 = 0x80000000", "rule": "bound: tensor.ne.*"}
    assert statement(bound).startswith("a GET_MAX_SIZE with a bound flaw (tensor.ne.3 = 0x80000000) kills")
    assert "| corruption/-/MEMSET_TENSOR/valid | corruption | MEMSET_TENSOR |  | yes | **new** |" in text


def test_a_kit_found_bug_is_absent_where_the_server_stops_at_its_own_check():
    n1 = next(b for b in NEW_BUGS if b.key == "N1")
    at_check = {"status": "killed by signal SIGABRT", "log_tail": [
        "/b/ggml/src/ggml-rpc/ggml-rpc.cpp:1416: GGML_ASSERT(tensor->data >= buffer_start) failed"]}
    cell = judge(n1, {"SHADOW-011": result("SHADOW-011", "fail", death=at_check)}, {}, found="present")
    assert cell == "absent: the server stops at its own check (SHADOW-011 dies at ggml-rpc.cpp:1416)"
    freed = {"status": "killed by signal SIGABRT", "log_tail": ["free(): invalid pointer"]}
    cell = judge(n1, {"SHADOW-011": result("SHADOW-011", "fail", death=freed)}, {"SHADOW-011": True}, found="present")
    assert cell == "**present**: SIGABRT (SHADOW-011) (verified)"
    changed = result("SHADOW-011", "fail", message="COPY_TENSOR of F32 ne=(7, 3, 0, 1) [empty-2/other-buffer], data "
                     "= base - 6624: buffer #3 (1024 bytes, sentinel) changed: 1 byte(s) at offsets [96, 97)")
    assert judge(n1, {"SHADOW-011": changed}, {}, found="present") == (
        "**present**: fails: buffer #3 (1024 bytes, sentinel) changed: 1 byte(s) at offsets [96, 97) (SHADOW-011)")
    # The evidence is shown whole up to its last offset (a cut at 120 characters once ended a cell in "[96, 9").
    long = result("SHADOW-011", "fail", message="COPY_TENSOR of F32 ne=(7, 3, 0, 1) nb=(4, 28, 84, 84) [empty-2/"
                  "other-buffer], 0 bytes, data = base - 7712 of a 4096-byte buffer: buffer #1 (1024 bytes, sentinel "
                  "before the working buffer) changed, a buffer of the session: 1 byte(s) at offsets [96, 97)")
    assert judge(n1, {"SHADOW-011": long}, {}, found="present").endswith("at offsets [96, 97) (SHADOW-011)")
    endless = result("SHADOW-011", "fail", message="buffer #2 changed: " + "x" * 400)
    cell = judge(n1, {"SHADOW-011": endless}, {}, found="present")
    assert cell.endswith("… (SHADOW-011)") and len(cell) < 260


def test_a_new_class_s_reproducer_is_kept_only_when_it_replays_clean_against_the_reference(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    clean = root / "fixtures" / "repro" / "v8-copy-tensor-zero-elements-below.pcap"
    wrong = tmp_path / "v7-as-8.pcap"
    wrong.write_bytes((root / "fixtures" / "repro" / "v7-graph-null-node.pcap").read_bytes())
    cls = {"kind": "crash", "command": "COPY_TENSOR", "rule": "valid", "verified": True}
    hunt = {"peer": "8.0.0", "classes": [{**cls, "class": "a", "reproducer": str(clean)},
                                         {**cls, "class": "b", "reproducer": str(wrong)},
                                         {**cls, "class": "c", "reproducer": str(clean), "verified": False}]}
    kept = keep_hunt_reproducers(hunt, tmp_path / "keep")
    assert [k["class"] for k in kept] == ["a"]
    assert (tmp_path / "keep" / "hunt-8.0.0" / clean.name).read_bytes() == clean.read_bytes()
    a, b, c = hunt["classes"]
    assert a["kept"].endswith(f"hunt-8.0.0/{clean.name}")
    assert "not_kept" in b and "kept" not in b and "kept" not in c and "not_kept" not in c
    # A class whose reproducer is kept there already (an earlier run's hunt) stays as it is.
    again = {"peer": "8.0.0", "classes": [{**cls, "class": "a", "reproducer": a["kept"]}]}
    assert [k["file"] for k in keep_hunt_reproducers(again, tmp_path / "keep")] == [a["kept"]]
