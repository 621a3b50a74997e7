"""``ggml-rpc check`` end to end: the embedded reference servers pass, reports are well formed, dead and foreign
servers are handled, user mistakes end with one line and exit code 2."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from breakers import BREAKERS
from faulty import Breaker, Conn, Msg, RewriteReply, faulty_server
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.cli import main
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V6, V7, Command, GgmlOp

HERE = Path(__file__).resolve().parent
FRAGILE = HERE / "fragile_server.py"


def run_check(args: list[str], tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["check", *args, "--json", str(out)])
    return code, json.loads(out.read_text())


def by_id(report: dict) -> dict[str, dict]:
    return {r["id"]: r for r in report["results"]}


@pytest.mark.parametrize("proto", ["7", "6", "7.0.1"])
def test_embedded_reference_server_passes_everything(proto: str, tmp_path: Path) -> None:
    code, report = run_check(["--proto", proto, "--junit", str(tmp_path / "r.xml")], tmp_path)
    s = report["summary"]
    assert code == 0
    assert s["must_failures"] == 0 and s["should_failures"] == 0 and s["error"] == 0, report
    assert s["total"] == len(CATALOGUE)
    assert report["server"]["verdict"] == f"speaks {proto if proto.count('.') == 2 else proto + '.0'}"
    assert report["server"]["cache"] is True
    results = by_id(report)
    mine, other = ("V6", "V7") if proto == "6" else ("V7", "V6")
    for cid, r in results.items():
        if cid.startswith(f"CACHE-{mine}-"):
            assert r["outcome"] == "pass", r
        if cid.startswith(f"CACHE-{other}-"):
            assert r["outcome"] == "unsupported", r
            assert "server speaks" in r["message"]
    assert all(r["outcome"] in ("pass", "unsupported", "skip") for r in results.values())


def test_strict_also_passes_and_isolation_runs_on_a_concurrent_server(tmp_path: Path) -> None:
    with running_server("7", cache_dir=str(tmp_path / "c"), concurrent=True) as ref:
        code, report = run_check(["--server", f"127.0.0.1:{ref.port}", "--cache-dir", str(tmp_path / "c"),
                                  "--strict", "--checks", "ISO-*,CACHE-V7-*"], tmp_path)
    assert code == 0
    assert {r["id"]: r["outcome"] for r in report["results"]} == {
        **{f"CACHE-V7-00{i}": "pass" for i in range(1, 8)}, "ISO-001": "pass", "ISO-002": "pass", "ISO-003": "pass"}


def test_server_without_cache_skips_cache_checks_with_a_reason(tmp_path: Path) -> None:
    with running_server("7") as ref:
        code, report = run_check(["--server", f"127.0.0.1:{ref.port}", "--checks", "cache-v7,FRAME-034"], tmp_path)
    assert code == 0
    for r in report["results"]:
        assert r["outcome"] == "skip", r
        assert "no hash cache observed" in r["message"]
    assert report["server"]["cache"] is False


def test_json_shape(tmp_path: Path) -> None:
    code, report = run_check(["--checks", "HELLO-00[12],DATA-003"], tmp_path)
    assert code == 0
    assert report["format"] == "ggml-rpc-check/1"
    assert set(report) >= {"kit_version", "server", "started", "duration_s", "strict", "exit_code", "summary",
                           "results"}
    assert set(report["server"]) == {"target", "address", "hello", "verdict", "devices", "cache"}
    r = report["results"][0]
    assert set(r) == {"id", "title", "category", "level", "versions", "spec", "outcome", "failed_level", "message",
                      "duration_s", "evidence", "server_death", "pcap", "html"}
    assert [x["id"] for x in report["results"]] == ["HELLO-001", "HELLO-002", "DATA-003"]
    assert r["spec"] == "spec/PROTOCOL.md#v7-hello"
    assert by_id(report)["DATA-003"]["spec"] == "spec/PROTOCOL.md#v7-get_alignment"


def test_failures_carry_evidence_in_json_and_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = BREAKERS["DATA-007"]()
    with running_server("7") as ref, faulty_server(ref.address, V7, broken) as bad:
        code = main(["check", "--server", f"127.0.0.1:{bad.port}", "--checks", "DATA-00[5-8],HELLO-004",
                     "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    assert code == 1
    text = capsys.readouterr().out
    assert "DATA-007 FAIL" in text and "NOT conformant" in text
    report = json.loads((tmp_path / "r.json").read_text())
    fail = by_id(report)["DATA-007"]
    assert fail["outcome"] == "fail" and fail["failed_level"] == "MUST"
    assert any(e["expected"] and e["got"] for e in fail["evidence"])
    assert report["summary"]["must_failures"] == 1 and report["exit_code"] == 1
    root = ET.parse(tmp_path / "r.xml").getroot()
    failures = [f for suite in root if suite.get("name") != "verdict" for f in suite.findall("testcase/failure")]
    assert len(failures) == 1 and failures[0].get("type") == "MUST"
    assert root.find("testsuite[@name='verdict']/testcase/failure").get("type") == "not conformant"
    assert "DATA-007" in (failures[0].text or "") and "expected" in (failures[0].text or "")


def _check_junit_structure(root: ET.Element) -> None:
    """The element, attribute and order rules of the common JUnit XML schema (Jenkins junit-10.xsd)."""
    assert root.tag == "testsuites"
    suites = list(root)
    assert suites and all(s.tag == "testsuite" for s in suites)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for attr in ("name", "tests", "failures", "errors", "skipped", "time", "timestamp", "hostname", "id",
                     "package"):
            assert suite.get(attr) is not None, attr
        assert set(suite.attrib) <= {"name", "tests", "failures", "errors", "time", "disabled", "skipped",
                                     "timestamp", "hostname", "id", "package", "file", "log", "url", "version"}
        float(suite.get("time") or "x")
        tags = [c.tag for c in suite]
        # properties?, testcase*, system-out, system-err, in this order
        assert tags[0] == "properties" and tags[-2:] == ["system-out", "system-err"]
        assert set(tags[1:-2]) <= {"testcase"}
        cases = suite.findall("testcase")
        assert int(suite.get("tests") or -1) == len(cases)
        counted = {"failures": 0, "errors": 0, "skipped": 0}
        for case in cases:
            assert case.get("name") and case.get("classname")
            assert set(case.attrib) <= {"name", "assertions", "time", "classname", "status", "class", "file", "line"}
            float(case.get("time") or "x")
            kids = [k.tag for k in case]
            assert set(kids) <= {"failure", "error", "skipped", "system-out", "system-err"}
            order = {"skipped": 0, "error": 1, "failure": 2, "system-out": 3, "system-err": 4}
            assert [order[k] for k in kids] == sorted(order[k] for k in kids)
            for f in case.findall("failure") + case.findall("error"):
                assert f.get("message") is not None and f.get("type")
            counted["failures"] += len(case.findall("failure"))
            counted["errors"] += len(case.findall("error"))
            counted["skipped"] += len(case.findall("skipped"))
        for key, n in counted.items():
            assert int(suite.get(key) or -1) == n, key
            totals[key] += n
        totals["tests"] += len(cases)
    assert set(root.attrib) <= {"name", "time", "tests", "failures", "disabled", "errors"}
    for key in ("tests", "failures", "errors"):
        assert int(root.get(key) or -1) == totals[key], key


def test_junit_is_structurally_valid(tmp_path: Path) -> None:
    broken = BREAKERS["HELLO-004"]()
    with running_server("7") as ref, faulty_server(ref.address, V7, broken) as bad:
        main(["check", "--server", f"127.0.0.1:{bad.port}", "--checks", "HELLO-*,cache-v6,DATA-00[1-3]",
              "--junit", str(tmp_path / "r.xml")])
    root = ET.parse(tmp_path / "r.xml").getroot()
    _check_junit_structure(root)
    assert sum(int(s.get("skipped") or 0) for s in root) == 5  # the five v6 cache checks on a v7 server
    assert int(root.get("failures") or 0) == 1  # HELLO-004, a SHOULD


def test_should_failure_fails_only_with_strict(tmp_path: Path) -> None:
    broken = BREAKERS["HELLO-004"]()
    with running_server("7") as ref, faulty_server(ref.address, V7, broken) as bad:
        address = f"127.0.0.1:{bad.port}"
        assert main(["check", "--server", address, "--checks", "HELLO-004"]) == 0
        assert main(["check", "--server", address, "--checks", "HELLO-004", "--strict"]) == 1


def test_an_unknown_major_is_not_covered_and_only_handshake_checks_run(tmp_path: Path) -> None:
    nine = RewriteReply(Command.HELLO, lambda conn, msg, body: bytes([9, 0, 0]) + body[3:])
    with running_server("7") as ref, faulty_server(ref.address, V7, nine) as bad:
        code, report = run_check(["--server", f"127.0.0.1:{bad.port}"], tmp_path)
    assert code == 3 and report["verdict"]["state"] == "not covered"
    assert report["server"]["verdict"] == "speaks 9.x: not covered by this kit"
    results = by_id(report)
    assert results["HELLO-001"]["outcome"] == "pass"
    assert results["HELLO-002"]["outcome"] == "unsupported" and "not covered" in results["HELLO-002"]["message"]
    for cid, r in results.items():
        if not cid.startswith("HELLO-00") or cid in ("HELLO-006", "HELLO-007", "HELLO-008", "HELLO-009"):
            assert r["outcome"] == "skip", r
            assert "only handshake checks run" in r["message"]


def test_expected_version_mismatch_fails_the_handshake_check(tmp_path: Path) -> None:
    with running_server("6") as ref:
        code, report = run_check(["--server", f"127.0.0.1:{ref.port}", "--proto", "7", "--checks", "HELLO-002"],
                                 tmp_path)
    assert code == 1
    assert "announces 6.0.0" in report["results"][0]["message"]


def test_declined_op_is_unsupported_not_failed(tmp_path: Path) -> None:
    class NoMatMul(Breaker):
        def request(self, conn: Conn, msg: Msg):
            if msg.cmd == Command.GRAPH_COMPUTE and msg.fields is not None and int(GgmlOp.MUL_MAT) in \
                    msg.fields["tensors"]["op"].tolist():
                from faulty import Act

                return Act(forward=None, close=True)
            return None

    with running_server("7") as ref, faulty_server(ref.address, V7, NoMatMul()) as bad:
        code, report = run_check(["--server", f"127.0.0.1:{bad.port}", "--checks", "COMPUTE-00[14]"], tmp_path)
    assert code == 0
    results = by_id(report)
    assert results["COMPUTE-001"]["outcome"] == "pass"
    assert results["COMPUTE-004"]["outcome"] == "unsupported"
    assert "MUL_MAT" in results["COMPUTE-004"]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_without_spawn_ends_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(FRAGILE), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        from ggml_rpc.conformance.harness import wait_for_port

        assert wait_for_port("127.0.0.1", port, 20)
        code, report = run_check(["--server", f"127.0.0.1:{port}", "--checks", "FRAME-03[0-3],DATA-001"], tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    results = by_id(report)
    assert results["FRAME-030"]["outcome"] == "pass"
    died = results["FRAME-031"]
    assert died["outcome"] == "fail" and died["failed_level"] == "MUST"  # FRAME-031's own level
    assert "stopped answering" in died["message"]
    for cid in ("FRAME-032", "FRAME-033", "DATA-001"):
        assert results[cid]["outcome"] == "not run"
        assert "after FRAME-031" in results[cid]["message"]
    assert code == 1 and report["verdict"]["deaths"] == 1  # a death is never conformant
    out, err = capsys.readouterr()
    # Warned before the run; told after it how many checks could not run and how --spawn runs them.
    assert err.count("\n") == 1 and "warning:" in err and "--profile safe" in err and "--spawn" in err
    assert f"server at 127.0.0.1:{port}: HELLO" in out  # the address once, not "... (127.0.0.1:P)"
    advice = next(line for line in out.splitlines() if "could not run" in line)
    assert advice.startswith("3 checks could not run") and "after FRAME-031" in advice and "--spawn" in advice
    # No tick beside a group whose checks did not run.
    groups = [line for line in out.splitlines() if "not run" in line and "/" in line.split()[2]]
    assert groups and not any(line.startswith("✓") for line in groups), groups


def test_quiet_prints_the_verdict_line_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "-q", "--checks", "HELLO-*,DATA-00[1-5]"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [out.strip()] and out.startswith("→ conformant"), out


def test_spawned_server_is_restarted_and_its_death_recorded(tmp_path: Path) -> None:
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(FRAGILE))} --port {{port}}"
    code, report = run_check(["--spawn", cmd, "--checks", "FRAME-03[0-2],DATA-001", "--strict"], tmp_path)
    results = by_id(report)
    died = results["FRAME-031"]
    assert died["outcome"] == "fail" and died["failed_level"] == "MUST"
    assert died["server_death"]["status"] == "killed by signal SIGABRT"
    assert any("null node" in line for line in died["server_death"]["log_tail"])
    assert results["FRAME-032"]["outcome"] == "pass" and results["DATA-001"]["outcome"] == "pass"
    assert code == 1


def test_list_prints_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    for c in CATALOGUE:
        assert c.id in out
    assert f"{len(CATALOGUE)} checks" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "127.0.0.1:1"], "cannot reach 127.0.0.1:1"),
        (["--server", "localhost"], "expected HOST:PORT"),
        (["--proto", "9"], "unknown protocol version"),
        (["--checks", "NOTHING-*"], "matches no check"),
        (["--spawn", "true"], "{port} placeholder"),
        (["--spawn", "/nonexistent/server {port}"], "cannot start"),
        (["--spawn", f"{sys.executable} -c pass --port {{port}}"], "did not listen"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_pytest_plugin_runs_the_catalogue(tmp_path: Path) -> None:
    broken = BREAKERS["DATA-006"]()
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "ggml_rpc.conformance.checks"]
    good = subprocess.run([*base, "-k", "HELLO or DATA-00"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "18 passed" in good.stdout
    with running_server("7") as ref, faulty_server(ref.address, V7, broken) as bad:
        bad_run = subprocess.run([*base, "--rpc-server", f"127.0.0.1:{bad.port}", "-k", "DATA-006 or cache-v6 or "
                                  "CACHE-V6"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad_run.returncode == 1, bad_run.stdout
    assert "1 failed" in bad_run.stdout and "5 skipped" in bad_run.stdout
    assert "DATA-006" in bad_run.stdout and "expected:" in bad_run.stdout


def test_every_check_has_a_stable_id_and_a_spec_link() -> None:
    import re

    ids = [c.id for c in CATALOGUE]
    assert len(ids) == len(set(ids))
    for c in CATALOGUE:
        assert re.fullmatch(r"(HELLO|FRAME|DATA|CACHE-V[67]|ISO|COMPUTE|COMM|SHADOW)-\d{3}", c.id), c.id
        for proto in (V6, V7, None):
            assert c.spec_link(proto).startswith("spec/PROTOCOL.md#")


def test_spec_links_point_at_anchors_of_the_generated_reference() -> None:
    import re

    from ggml_rpc.spec.render.markdown import render_markdown

    anchors = set(re.findall(r'<a id="([^"]+)"', render_markdown(None)))
    for c in CATALOGUE:
        for proto in (V6, V7, None):
            assert c.spec_link(proto).split("#", 1)[1] in anchors, (c.id, c.spec_link(proto))


def test_spawned_serve_process_passes_strict_with_white_box_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    serve = f"{shlex.quote(sys.executable)} -m ggml_rpc.conformance.cli serve --port {{port}} --proto 6 " \
            f"--cache-dir {shlex.quote(str(cache))}"
    code, report = run_check(["--spawn", serve, "--cache-dir", str(cache), "--strict"], tmp_path)
    assert code == 0, report["summary"]
    assert report["server"]["verdict"] == "speaks 6.0"
    assert by_id(report)["CACHE-V6-005"]["outcome"] == "pass"
    assert report["summary"]["not run"] == 0


@pytest.mark.parametrize(("answer", "message"), [(None, "timed out"), (b"HTTP/1.1 400 Bad Request\r\n\r\n", "HELLO")])
def test_a_server_that_does_not_speak_the_protocol_is_a_usage_error(
    answer: bytes | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert main(["check", "--server", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 2
    finally:
        listener.close()
        for c in held:
            c.close()
    err = capsys.readouterr().err
    assert "does not answer HELLO" in err and message in err
    assert err.count("\n") == 1


def test_a_death_on_the_first_step_of_a_must_check_is_its_must_failure(tmp_path: Path) -> None:
    """FRAME-010 against upstream: the server dies on the first GET_TENSOR and the check's next connect is refused.
    The verdict is the death (at the check's level, MUST, naming the signal and the step), not "connection
    refused"."""
    cmd = (f"{shlex.quote(sys.executable)} {shlex.quote(str(FRAGILE))} --port {{port}} --die-on get-tensor "
           "--startup-delay 0.5")
    code, report = run_check(["--spawn", cmd, "--checks", "FRAME-010,HELLO-001,DATA-001"], tmp_path)
    results = by_id(report)
    died = results["FRAME-010"]
    assert died["outcome"] == "fail" and died["failed_level"] == "MUST"
    assert died["message"].startswith("server died during step 'GET_TENSOR")
    assert "killed by signal SIGABRT" in died["message"] and "refused" not in died["message"]
    last = died["evidence"][-1]
    assert last["got"] == "killed by signal SIGABRT" and last["sent"]
    # The restarted server (slow to listen) is waited for: the next checks see a server, not a refused connect.
    assert results["HELLO-001"]["outcome"] == "pass" and results["DATA-001"]["outcome"] == "pass"
    assert report["summary"]["must_failures"] == 1 and code == 1


@pytest.mark.parametrize("option", ["--html", "--pcap-dir", "--json", "--junit", "--sarif"])
def test_every_output_path_is_checked_before_the_run(option: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An output that cannot be written ends the command before the first check (--html once did after 135)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with running_server(V7) as srv:  # a server that answers: a run would reach it
        code = main(["check", "--server", f"{srv.host}:{srv.port}", option, str(blocker / "sub" / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and option in err, err
    assert "ggml-rpc check" not in out  # no header: nothing ran
