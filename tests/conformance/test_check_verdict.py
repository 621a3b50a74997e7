"""One verdict, the same in the terminal, JSON, JUnit, SARIF, HTML and the exit code.

Each case is a server that today's kit called "conformant": a version the kit does not cover that closes on
everything after HELLO, a server that computes nothing, a server that dies, a server refusing the harness's own
setup.  Each must now give a verdict other than "conformant", and every format must say the same.
"""

from __future__ import annotations

import json
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from faulty import Act, Breaker, Conn, Msg, faulty_server
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness.verdict import EXIT_CODES, State
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7, Command

HERE = Path(__file__).resolve().parent
FRAGILE = HERE / "fragile_server.py"


class FutureVersion(Breaker):
    """Announces 9.0.0 and closes on everything after HELLO (a server of a version the kit does not know)."""

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        return None if msg.cmd == Command.HELLO else Act(forward=None, close=True)

    def reply(self, conn: Conn, msg: Msg, body: bytes) -> bytes:
        return bytes([9, 0, 0]) + body[3:] if msg.cmd == Command.HELLO else body


class NoCompute(Breaker):
    """Closes the connection on every GRAPH_COMPUTE."""

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        return Act(forward=None, close=True) if msg.cmd == Command.GRAPH_COMPUTE else None


def run_all_formats(args: list[str], out: Path) -> tuple[int, dict, ET.Element, dict, str]:
    """``check`` with every report; the exit code, JSON, JUnit root, SARIF and the HTML index."""
    code = main(["check", *args, "--json", str(out / "r.json"), "--junit", str(out / "r.xml"),
                 "--sarif", str(out / "r.sarif"), "--html", str(out / "html")])
    return (code, json.loads((out / "r.json").read_text()), ET.parse(out / "r.xml").getroot(),
            json.loads((out / "r.sarif").read_text()), (out / "html" / "index.html").read_text())


def assert_formats_agree(code: int, report: dict, junit: ET.Element, sarif: dict, index: str, state: State) -> None:
    assert code == EXIT_CODES[state] == report["exit_code"] == report["verdict"]["exit_code"]
    assert report["verdict"]["state"] == state.value
    verdict_suite = [s for s in junit if s.get("name") == "verdict"]
    assert len(verdict_suite) == 1
    props = {p.get("name"): p.get("value") for p in junit.iter("property")}
    assert props["verdict"] == state.value
    failure = verdict_suite[0].find("testcase/failure")
    assert (failure is None) == (state is State.CONFORMANT)
    if failure is not None:
        assert failure.get("type") == state.value and failure.get("message") == report["verdict"]["line"]
    run = sarif["runs"][0]
    assert run["properties"]["verdict"]["state"] == state.value
    assert run["invocations"][0]["exitCode"] == code
    assert run["invocations"][0]["executionSuccessful"] == (state is State.CONFORMANT)
    # The HTML index opens with the same verdict line, before the first category table.
    line = report["verdict"]["line"].replace("'", "&#x27;")
    assert 'class="verdict' in index and line in index
    assert index.index(line) < index.index('<h2 id="handshake"') if '<h2 id="handshake"' in index else True


def test_a_version_the_kit_does_not_cover_is_not_covered_with_its_own_exit_code(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]
                                                                                ) -> None:
    with running_server("7") as ref, faulty_server(ref.address, V7, FutureVersion()) as bad:
        code, report, junit, sarif, index = run_all_formats(["--server", f"127.0.0.1:{bad.port}"], tmp_path)
    assert_formats_agree(code, report, junit, sarif, index, State.NOT_COVERED)
    assert code == 3
    assert report["verdict"]["not_covered"] > 90
    assert "→ not covered" in capsys.readouterr().out


def test_no_compute_at_all_fails_the_compute_checks(tmp_path: Path) -> None:
    with running_server("7") as ref, faulty_server(ref.address, V7, NoCompute()) as bad:
        code, report, junit, sarif, index = run_all_formats(
            ["--server", f"127.0.0.1:{bad.port}", "--checks", "COMPUTE-00[1-3]"], tmp_path)
    assert_formats_agree(code, report, junit, sarif, index, State.NOT_CONFORMANT)
    for r in report["results"]:
        assert r["outcome"] == "fail" and r["failed_level"] == "MUST", r
        assert "computes no graph at all" in r["message"]
    assert report["verdict"]["failures"] == ["COMPUTE-001", "COMPUTE-002", "COMPUTE-003"]


def test_a_death_fails_its_check_at_its_own_level_in_every_format(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(FRAGILE))} --port {{port}}"
    code, report, junit, sarif, index = run_all_formats(["--spawn", cmd, "--checks", "FRAME-03[01],DATA-001"],
                                                        tmp_path)
    assert_formats_agree(code, report, junit, sarif, index, State.NOT_CONFORMANT)
    died = {r["id"]: r for r in report["results"]}["FRAME-031"]
    assert died["level"] == "MUST" and died["outcome"] == "fail" and died["failed_level"] == "MUST"
    assert died["server_death"]["status"] == "killed by signal SIGABRT" and died["server_death"]["step"]
    assert report["verdict"]["deaths"] == 1 and "1 death," in report["verdict"]["line"]
    # JUnit: a failure of the check's level that says it died; SARIF: an error; HTML: "died", with the signal.
    case = next(c for c in junit.iter("testcase") if (c.get("name") or "").startswith("FRAME-031"))
    assert case.find("failure").get("type") == "MUST" and "died" in case.find("failure").get("message")
    assert [(r["ruleId"], r["level"]) for r in sarif["runs"][0]["results"]] == [("FRAME-031", "error")]
    assert 'class="outcome died">died (MUST)' in index and "killed by signal SIGABRT" in index
    assert "non-strict" not in index and "should_failures" not in index
    out = capsys.readouterr().out
    assert "FRAME-031 DIED (MUST)" in out and "→ NOT conformant" in out


def test_a_refused_setup_is_one_error_and_the_checks_it_blocked_are_blocked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve = f"{shlex.quote(sys.executable)} -m ggml_rpc.conformance.cli serve --port {{port}} --max-size 16"
    code, report, junit, sarif, index = run_all_formats(["--spawn", serve, "--checks", "DATA-00[6-9],DATA-030"],
                                                        tmp_path)
    assert_formats_agree(code, report, junit, sarif, index, State.INCOMPLETE)
    assert code == 4
    assert {r["outcome"] for r in report["results"]} == {"blocked"}
    assert report["summary"]["fail"] == 0 and report["verdict"]["leaks"] == 0
    [refusal] = report["verdict"]["setup_refusals"]
    assert "ALLOC_BUFFER refused" in refusal["cause"] and refusal["blocked"] == 5
    out = capsys.readouterr().out
    assert out.count("setup error:") == 1 and "5 checks blocked" in out
    assert "FAIL" not in out
    assert {e.get("type") for e in junit.iter("error")} == {"blocked"}


def test_a_should_failure_is_conformant_unless_strict_and_counted_on_the_line(tmp_path: Path) -> None:
    from breakers import BREAKERS

    with running_server("7") as ref, faulty_server(ref.address, V7, BREAKERS["HELLO-004"]()) as bad:
        code, report, junit, sarif, index = run_all_formats(["--server", f"127.0.0.1:{bad.port}", "--checks",
                                                             "HELLO-004"], tmp_path)
        assert_formats_agree(code, report, junit, sarif, index, State.CONFORMANT)
        strict = tmp_path / "strict"
        strict.mkdir()
        code, report, junit, sarif, index = run_all_formats(["--server", f"127.0.0.1:{bad.port}", "--checks",
                                                             "HELLO-004", "--strict"], strict)
    assert_formats_agree(code, report, junit, sarif, index, State.NOT_CONFORMANT)
    assert "1 SHOULD failure" in report["verdict"]["line"] and "(strict)" in report["verdict"]["line"]


def test_the_help_documents_the_verdicts_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("0 conformant", "1 not conformant", "3 not covered", "4 incomplete", "2 usage error",
                  "130 interrupted"):
        assert words in text


def test_the_check_page_marks_the_failing_step_and_its_evidence_wraps(tmp_path: Path) -> None:
    from breakers import BREAKERS

    with running_server("7") as ref, faulty_server(ref.address, V7, BREAKERS["DATA-007"]()) as bad:
        code, *_, index = run_all_formats(["--server", f"127.0.0.1:{bad.port}", "--checks",
                                                             "DATA-007"], tmp_path)
    assert code == 1
    page = (tmp_path / "html" / "checks" / "DATA-007.html").read_text()
    assert page.count('class="failing-step"') == 1 and "✗ failing step:" in page
    css = (tmp_path / "html" / "style.css").read_text()
    assert "overflow-wrap: anywhere" in css and "white-space: pre-wrap" in css
    # The index names the failing check before the first category table, with its level and reason.
    failures = index.index('id="failures"')
    assert failures < index.index('<h2 id="data"') and index.index("DATA-007", failures) < index.index('<h2 id="data"')
    assert "Legend" in index and "kit version" in index and "date" in index
