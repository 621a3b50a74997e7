"""``fuzz --hunt --spawn`` and ``check --spawn`` through the kit's fork server: deaths cost a fork, findings and
verdicts are those of a server restarted as a new process.

The server is ``vulnerable.py`` (the reference with upstream's buffer-range abort put back) with one BLAS thread, so
that it has a single thread when it first accepts a connection (the fork server's condition).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from ggml_rpc.conformance.cli import main
from vulnerable import command as spawn

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and not os.environ.get("CI"),
                                reason="the fork server is compiled with the system's C compiler (none here)")


def test_a_hunt_restarts_by_fork_and_verifies_each_class(tmp_path, capsys):
    out = tmp_path / "found"
    assert main(["fuzz", "--hunt", "--spawn", spawn(), "--examples", "4", "--seed", "3", "--timeout", "2",
                 "--out", str(out)]) == 1
    text, err = capsys.readouterr()
    assert "restarts: forks of the server" in err
    report = json.loads((out / "findings.json").read_text())
    # Every restart (after a death, and before each shrinking and verifying replay) was a fork.
    assert report["restarts"] >= 1 and report["fork_restarts"] == report["restarts"]
    assert report["classes"] and all(c["verified"] and c["symptom"].startswith("SIGABRT")
                                     for c in report["classes"]), report["classes"]
    assert f"({report['fork_restarts']} of them forks)" in text


def test_a_hunt_reads_each_copys_sanitizer_report(tmp_path):
    out = tmp_path / "found"
    assert main(["fuzz", "--hunt", "--spawn", spawn("asan"), "--examples", "4", "--seed", "3", "--timeout", "2",
                 "--out", str(out)]) == 1
    report = json.loads((out / "findings.json").read_text())
    assert report["fork_restarts"] >= 1
    assert report["classes"] and all(c["verified"] and c["symptom"].startswith("ASan heap-buffer-overflow")
                                     for c in report["classes"]), report["classes"]


def _check(capsys, *extra: str) -> tuple[int, dict, str]:
    code = main(["check", "--spawn", spawn(), "--checks", "HELLO-*,FRAME-010,DATA-011", "--json", "-", *extra])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_check_verdicts_are_those_of_a_restarted_process(capsys):
    forked_code, forked, forked_err = _check(capsys, "--fork-server")
    plain_code, plain, plain_err = _check(capsys)
    assert "restarts: forks of the server" in forked_err and "restarts: a new server process each" in plain_err
    assert forked_code == plain_code == 1

    def outcomes(report: dict) -> list[tuple]:
        return [(r["id"], r["outcome"], (r.get("server_death") or {}).get("status")) for r in report["results"]]

    assert outcomes(forked) == outcomes(plain)
    assert any(status == "killed by signal SIGABRT" for _, _, status in outcomes(forked))
