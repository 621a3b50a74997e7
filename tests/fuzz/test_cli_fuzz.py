"""``ggml-rpc fuzz`` from the command line: embedded, external and spawned targets, budgets, user mistakes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.reference import running_server
from vulnerable import command as vulnerable


def test_embedded_campaign_finds_nothing(tmp_path, capsys):
    assert main(["fuzz", "--seconds", "4", "--seed", "3", "--out", str(tmp_path / "f")]) == 0
    out, err = capsys.readouterr()
    header = next(line for line in err.splitlines() if line.startswith("fuzzing "))
    assert header.startswith("fuzzing embedded reference server at 127.0.0.1:")
    assert header.count("protocol") == 1 and header.endswith(", protocol 7.0.0, seed 3")
    assert "findings: 0 crash, 0 hang, 0 wrong-reply, 0 out-of-buffer" in out
    assert "execs/s" in out and "rules broken:" in out
    assert not (tmp_path / "f").exists()  # nothing found, nothing written


def test_external_server_by_examples(tmp_path, capsys):
    # The reference server's default budget (4 GiB per device), which the model must learn and share.
    with running_server("6") as srv:
        assert main(["fuzz", "--server", f"{srv.host}:{srv.port}", "--examples", "3", "--steps", "20",
                     "--out", str(tmp_path / "f")]) == 0
    out, err = capsys.readouterr()
    assert f"fuzzing server at {srv.host}:{srv.port}, protocol 6.0.0" in err  # the address once
    assert out.startswith("3 examples") or " examples," in out
    assert not (tmp_path / "f").exists()


def test_a_spawned_server_that_crashes_is_restarted_the_finding_kept_and_nothing_else_left(tmp_path, monkeypatch,
                                                                                         capsys):
    from hypothesis.configuration import storage_directory

    home = storage_directory(intent_to_write=False).home_directory
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["fuzz", "--spawn", vulnerable(), "--examples", "300", "--seed", "1", "--out", "found"]) == 1
    out, err = capsys.readouterr()
    assert "FINDING crash" in err
    assert "killed by signal SIGABRT" in out
    restarts = int(re.search(r"target restarts (\d+)", out).group(1))
    assert restarts >= 1
    summary = next((cwd / "found").glob("finding-001-crash.txt")).read_text()
    assert "target status: killed by signal SIGABRT" in summary
    assert sorted(p.name for p in cwd.iterdir()) == ["found"]  # no .hypothesis/, no fuzz-findings/
    assert (cwd / "found" / "findings.txt").is_file()
    assert not (cwd / "found" / ".hypothesis").exists()
    assert storage_directory(intent_to_write=False).home_directory == home  # hypothesis' setting is restored


def test_hypothesis_mines_local_source_once_into_the_kit_cache(tmp_path):
    """Hypothesis draws some values from constants it finds in local source files (the kit's own modules on an
    editable install) and caches them by content. The cache lives in the kit's user cache, so a later campaign
    reads what an earlier one mined instead of parsing every module again inside its first examples. Each campaign
    is a process of its own: hypothesis keeps what it mined for the life of a process, which would change the draws
    of every later test here."""
    where = tmp_path / "src"
    where.mkdir()
    (where / "kit_local_constants.py").write_text("MAGIC = 0x5EED_C0DE_0001\nNAME = 'a local constant'\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))}
    argv = ["fuzz", "--examples", "3", "--steps", "20", "--seed", "5", "--out", str(tmp_path / "f")]
    code = f"import sys, kit_local_constants; from ggml_rpc.conformance.cli import main; sys.exit(main({argv!r}))"
    cached = tmp_path / "xdg" / "ggml-rpc-kit" / "hypothesis" / "constants"

    def campaign() -> dict[str, int]:
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        assert cached.is_dir(), "no constants cached in the kit's user cache"
        return {p.name: p.stat().st_mtime_ns for p in cached.iterdir()}

    first = campaign()
    # One file per local module mined, named by its source's hash (the local module here among them).
    assert any(str(0x5EED_C0DE_0001) in p.read_text() for p in cached.iterdir()), first
    assert campaign() == first  # the second campaign read them: nothing mined or written again
    assert not (tmp_path / "f").exists() and not (tmp_path / ".hypothesis").exists()


def test_a_server_restarted_as_a_new_process_has_its_log_in_the_finding(tmp_path, capsys):
    """Without the fork server every death costs a new process, whose output (here its start-up line) the
    finding's summary quotes."""
    out_dir = tmp_path / "found"
    assert main(["fuzz", "--hunt", "--no-fork-server", "--spawn", vulnerable(forkable=False), "--examples", "2",
                 "--seed", "3", "--timeout", "2", "--out", str(out_dir)]) == 1
    out, err = capsys.readouterr()
    assert "restarts: a new server process each" in err
    assert int(re.search(r"target restarts (\d+)", out).group(1)) >= 1
    summary = next(out_dir.glob("finding-001-crash.txt")).read_text()
    assert "target status: killed by signal SIGABRT" in summary
    assert "log: vulnerable reference server listening" in summary


def test_spawned_server(tmp_path, capsys):
    cmd = f"{shlex.quote(sys.executable)} -m ggml_rpc.conformance.cli serve --port {{port}} --proto 7.0.1 --mem 64M"
    assert main(["fuzz", "--spawn", cmd, "--examples", "2", "--steps", "15", "--out", str(tmp_path / "f")]) == 0
    out, err = capsys.readouterr()
    assert "spawned:" in err and "protocol 7.0.1" in err
    assert "0 crash" in out


@pytest.mark.parametrize("argv, message", [
    (["--examples", "0"], "--examples must be at least 1"),
    (["--seconds", "-1"], "--seconds must be positive"),
    (["--proto", "9"], "unknown protocol version"),
    (["--server", "nohost"], "expected HOST:PORT"),
    (["--server", "127.0.0.1:1", "--seconds", "1"], "cannot talk to 127.0.0.1:1"),
    (["--spawn", "/nonexistent/server --port {port}"], "cannot start"),
    (["--spawn", "true"], "needs a {port} placeholder"),
])
def test_user_mistakes_exit_2(argv, message, capsys):
    assert main(["fuzz", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_hunt_mode_writes_findings_json_and_sarif(tmp_path, capsys):
    cmd = vulnerable()
    out_dir, sarif, html_dir = tmp_path / "found", tmp_path / "report.sarif", tmp_path / "html"
    assert main(["fuzz", "--hunt", "--spawn", cmd, "--examples", "8", "--seed", "3", "--timeout", "2",
                 "--out", str(out_dir), "--sarif", str(sarif), "--html", str(html_dir)]) == 1
    out, err = capsys.readouterr()
    assert "FINDING crash" in err and "verified on a fresh target" in out
    classes = json.loads((out_dir / "findings.json").read_text())["classes"]
    log = json.loads(sarif.read_text())
    assert log["version"] == "2.1.0" and len(log["runs"][0]["results"]) == len(classes) >= 1
    assert all(c["verified"] and c["symptom"].startswith("SIGABRT") for c in classes), classes
    # The HTML report: one row per class, shown as a crash, each linking a page with the reproducer decoded.
    index = (html_dir / "index.html").read_text()
    assert index.count('class="outcome fail">crash<') == len(classes)
    pages = sorted((html_dir / "findings").glob("*.html"))
    assert len(pages) == len(classes)
    assert all('class="dir">client → server<' in p.read_text() for p in pages)


def test_ctrl_c_stops_cleanly_with_a_summary(tmp_path, capsys):
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        assert main(["fuzz", "--seconds", "60", "--out", str(tmp_path)]) == 130
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 30
    out, err = capsys.readouterr()
    assert "interrupted: stopping after the current example" in err
    assert "stopped: interrupted" in out and "findings: 0 crash" in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_whole_run_keeps_to_its_seconds(tmp_path, capsys):
    """Setup, examples and teardown within --seconds: long examples (many steps) once ran far past it, the budget
    being looked at only between examples (--seconds 40 ran 51 s)."""
    seconds = 6.0
    started = time.monotonic()
    assert main(["fuzz", "--seconds", f"{seconds:g}", "--steps", "3000", "--timeout", "1",
                 "--out", str(tmp_path / "f")]) == 0
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert "findings: 0 crash" in out
    assert took < seconds + 3, f"--seconds {seconds:g} took {took:.1f} s"


def test_sarif_on_standard_output_moves_the_summary_to_standard_error(tmp_path, capsys):
    assert main(["fuzz", "--examples", "2", "--steps", "10", "--out", str(tmp_path / "f"), "--sarif", "-"]) == 0
    out, err = capsys.readouterr()
    log = json.loads(out)  # standard output is the SARIF log alone
    assert log["version"] == "2.1.0" and log["runs"][0]["results"] == []
    assert "findings: 0 crash" in err
