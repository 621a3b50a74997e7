"""Sanitizer reports as findings: an instrumented server's reports are read from its output, classed by sanitizer,
kind, access and top upstream frame, and become the evidence of ``check``, ``fuzz`` and ``replay`` with ``--spawn``.

The servers are ``tests/fuzz/vulnerable.py`` variants that print reports in the format of the sanitized upstream
builds (an ASan report and exit code 1 on a read past a buffer; a UBSan report, survived, on every MEMSET_TENSOR).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness.sanitizer_log import MAX_REPORT_LINES, MAX_REPORTS, SanitizerLog, parse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))
from vulnerable import ASAN_REPORT, UBSAN_REPORT, command  # noqa: E402

FIXTURES = HERE.parents[1] / "fixtures" / "sanitizer"


def spawn(variant: str) -> str:
    """A variant restarted as a new process after each death (the checks below read a new process's report)."""
    return command(variant, forkable=False)


def test_an_asan_report_is_classed_by_its_first_upstream_frame():
    (report,) = parse("some server output\n" + ASAN_REPORT + "\nafter the report")
    assert (report.sanitizer, report.kind, report.access, report.size) == (
        "AddressSanitizer", "heap-buffer-overflow", "READ", 512)
    # memcpy's interceptor is the sanitizer's; the bug is the function that called it.
    assert report.top_frame is not None and report.top_frame.function == "ggml_backend_cpu_buffer_get_tensor"
    assert report.symptom == "ASan heap-buffer-overflow READ in ggml_backend_cpu_buffer_get_tensor"
    assert report.headline() == ("AddressSanitizer: heap-buffer-overflow READ of 512 bytes in "
                                 "ggml_backend_cpu_buffer_get_tensor (ggml-backend.cpp:2046)")
    # Only the access's stack: the allocation's (posix_memalign, ggml_aligned_malloc) is not part of the class.
    assert [f.function for f in report.frames] == ["__interceptor_memcpy", "ggml_backend_cpu_buffer_get_tensor",
                                                   "rpc_server::get_tensor", "main"]
    assert report.fatal and report.lines[-1].endswith("ABORTING")


def test_a_ubsan_report_names_its_check_and_recovers():
    (report,) = parse(UBSAN_REPORT)
    assert (report.sanitizer, report.kind, report.fatal) == ("UndefinedBehaviorSanitizer",
                                                             "signed-integer-overflow", False)
    assert report.where == "/build/llama.cpp/ggml/src/ggml.c:1207:38"
    assert report.symptom == "UBSan signed-integer-overflow in ggml_row_size"
    assert "cannot be represented in type 'long int'" in report.headline()


def test_a_segv_report_takes_its_access_from_the_signal_line():
    text = ("==7==ERROR: AddressSanitizer: SEGV on unknown address 0x000000000000 (pc 0x1 bp 0x2 sp 0x3 T0)\n"
            "==7==The signal is caused by a READ memory access.\n"
            "==7==Hint: address points to the zero page.\n"
            "    #0 0x55 in ggml_graph_compute_thread /b/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c:2900:17\n"
            "    #1 0x56 (/b/bin/libggml-cpu.so+0x4f00)\n"
            "SUMMARY: AddressSanitizer: SEGV /b/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c:2900:17 in x\n"
            "==7==ABORTING\n")
    (report,) = parse(text)
    assert report.symptom == "ASan SEGV READ in ggml_graph_compute_thread"
    assert report.frames[0].location == "/b/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c:2900"  # no column
    assert report.frames[1].location == "/b/bin/libggml-cpu.so+0x4f00"


def test_a_jump_to_the_faulting_address_is_named_a_call_through_a_bad_pointer():
    # As the instrumented 7.0.0 prints a MAP_CUSTOM2 node whose function pointer is 0x10: no stack at all.
    text = ("==11142==ERROR: AddressSanitizer: SEGV on unknown address 0x000000000010 (pc 0x000000000010 bp 0x7ffe "
            "sp 0x7ffe T0)\n==11142==Hint: pc points to the zero page.\n"
            "==11142==The signal is caused by a READ memory access.\n"
            "AddressSanitizer:DEADLYSIGNAL\nAddressSanitizer: nested bug in the same thread, aborting.\n")
    (report,) = parse(text)
    assert report.frames == [] and report.symptom == "ASan SEGV READ at pc = the faulting address"
    assert report.headline().endswith("a call through a bad pointer (pc 0x000000000010 is the faulting address)")


def test_phrased_errors_get_their_documented_kind():
    # As the instrumented 7.0.0 prints a SET_TENSOR whose size header claims 2^62 bytes (std::vector's new).
    text = ("==9275==ERROR: AddressSanitizer: allocator is out of memory trying to allocate 0x4000000000000000 bytes\n"
            "    #0 0x7f in operator new(unsigned long) ../../../../src/libsanitizer/asan/asan_new_delete.cpp:95\n"
            "    #1 0x7f in recv_msg /b/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:520\n"
            "==9275==ABORTING\n")
    (report,) = parse(text)
    assert report.symptom == "ASan out-of-memory in recv_msg"


def test_memory_is_bounded_whatever_the_server_prints():
    log = SanitizerLog()
    for _ in range(MAX_REPORTS + 50):
        for line in UBSAN_REPORT.splitlines():
            log.feed(line)
    assert log.count == MAX_REPORTS + 50 and len(log.reports) == MAX_REPORTS
    # However many came before (a campaign restarts its server thousands of times), the newest are kept: a
    # death's report is found after its process's mark.
    log.feed(ASAN_REPORT.splitlines()[1])
    (newest,) = log.since(MAX_REPORTS + 50)
    assert newest.kind == "heap-buffer-overflow" and log.since(log.count) == []
    flood = SanitizerLog()
    flood.feed(ASAN_REPORT.splitlines()[1])
    for i in range(10 * MAX_REPORT_LINES):
        flood.feed(f"    #{i} 0x1 in f{i} /x.c:{i}")
    assert len(flood.reports[0].lines) == MAX_REPORT_LINES and len(flood.reports[0].frames) <= MAX_REPORT_LINES


def test_real_reports_are_there_to_parse():
    # The parametrized test below would only be skipped if the fixtures went missing.
    assert len(sorted(FIXTURES.glob("*.txt"))) >= 3


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.txt")), ids=lambda p: p.stem)
def test_reports_of_the_real_instrumented_builds_parse(path):
    """Reports printed by the sanitized upstream peers (``upstream install --sanitize address``); the file's first
    line says what the report must be classed as."""
    expected, _, text = path.read_text().partition("\n")
    reports = parse(text)
    assert reports, path
    assert reports[0].symptom == expected.removeprefix("# symptom: ").strip()


def test_check_fails_on_a_survived_report_and_names_the_asan_death(tmp_path, capsys):
    code = main(["check", "--spawn", spawn("ubsan"), "--checks", "DATA-011,DATA-006", "--json", "-"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    results = {r["id"]: r for r in out["results"]}
    assert results["DATA-006"]["outcome"] == "pass"  # no MEMSET_TENSOR, no report
    memset = results["DATA-011"]
    assert memset["outcome"] == "fail" and memset["failed_level"] == "MUST"
    assert "UndefinedBehaviorSanitizer: signed-integer-overflow in ggml_row_size (ggml.c:1207)" in memset["message"]

    code = main(["check", "--spawn", spawn("asan"), "--checks", "FRAME-010", "--json", "-"])
    out = json.loads(capsys.readouterr().out)
    (result,) = out["results"]
    assert code == 1 and result["outcome"] == "fail"
    death = result["server_death"]
    assert death["status"].startswith("exited with code 1 after AddressSanitizer: heap-buffer-overflow READ")
    assert death["sanitizer"]["top_frame"] == "ggml_backend_cpu_buffer_get_tensor (ggml-backend.cpp:2046)"


def test_hunt_classes_sanitizer_findings_and_verifies_them(tmp_path, capsys):
    out_dir, sarif = tmp_path / "found", tmp_path / "hunt.sarif"
    assert main(["fuzz", "--hunt", "--spawn", spawn("ubsan"), "--examples", "6", "--seed", "2", "--timeout", "2",
                 "--out", str(out_dir), "--sarif", str(sarif)]) == 1
    capsys.readouterr()
    classes = json.loads((out_dir / "findings.json").read_text())["classes"]
    ub = [c for c in classes if c["kind"] == "undefined-behaviour"]
    assert ub and all(c["verified"] for c in ub), classes
    assert {c["symptom"] for c in ub} == {"UBSan signed-integer-overflow in ggml_row_size"}
    # One class per (report class, command): the rule broken to get there does not split it.
    assert len({c["command"] for c in ub}) == len(ub)
    assert all(c["sanitizer"]["kind"] == "signed-integer-overflow" for c in ub)
    rules = {r["id"] for r in json.loads(sarif.read_text())["runs"][0]["tool"]["driver"]["rules"]}
    assert {c["class"] for c in ub} <= rules
    text = next(out_dir.glob("finding-*-undefined-behaviour.txt")).read_text()
    assert "sanitizer: /build/llama.cpp/ggml/src/ggml.c:1207:38: runtime error" in text


def test_hunt_takes_an_asan_death_class_from_the_report(tmp_path, capsys):
    out_dir = tmp_path / "found"
    # Forkable: the hunt's many deaths cost forks of the server (the kit's fork server), each with its own report.
    assert main(["fuzz", "--hunt", "--spawn", command("asan"), "--examples", "8", "--seed", "3", "--timeout", "2",
                 "--out", str(out_dir)]) == 1
    capsys.readouterr()
    classes = json.loads((out_dir / "findings.json").read_text())["classes"]
    asan = [c for c in classes if c["symptom"].startswith("ASan ")]
    assert asan and all(c["verified"] and c["kind"] == "crash" for c in asan), classes
    assert {c["symptom"] for c in asan} == {"ASan heap-buffer-overflow READ in ggml_backend_cpu_buffer_get_tensor"}


def test_replay_reports_survived_reports_per_connection(tmp_path, capsys):
    out = tmp_path / "pcaps"
    assert main(["check", "--checks", "DATA-011", "--pcap-dir", str(out), "--pcap-all"]) == 0
    capsys.readouterr()
    code = main(["replay", str(out / "DATA-011.pcap"), "--spawn", spawn("ubsan"), "--timeout", "5", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    found = [m for m in report["mismatches"] if m["kind"] == "sanitizer"]
    assert found and "signed-integer-overflow" in found[0]["got"]
