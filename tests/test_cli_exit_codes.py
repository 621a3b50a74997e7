"""Exit codes the shell sees: a reader that closes the pipe early is not an error (0), a lint that checked nothing
is one (2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter

CLI = [sys.executable, "-m", "ggml_rpc.conformance.cli"]
FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "v7-inference.pcap")


def run_into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run the CLI with standard output a pipe whose reader is already gone: the first write fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([*CLI, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("argv", [
    ["check", "--checks", "HELLO-001"],
    ["check", "--list"],
    ["decode", FIXTURE],
    ["lint", FIXTURE],
    ["spec"],
    ["--help"],
    ["check", "--help"],
    ["--version"],
])
def test_a_closed_standard_output_ends_the_command_with_exit_code_0(argv):
    proc = run_into_closed_pipe(argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_check_piped_into_head_exits_0():
    # `ggml-rpc check | head -1`: the reader goes away while the run is still printing.
    proc = subprocess.Popen([*CLI, "check", "--checks", "HELLO-*,FRAME-00*"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith("ggml-rpc check ")
    assert code == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err


def test_lint_with_a_port_no_connection_uses_is_a_usage_error(capsys):
    assert main(["lint", FIXTURE, "--port", "1234"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"ggml-rpc lint: error: no TCP connection with port 1234 in {FIXTURE}\n"
    assert captured.out == ""


def test_lint_of_a_capture_without_tcp_says_so(tmp_path, capsys):
    empty = tmp_path / "empty.pcap"
    PcapWriter(empty).close()
    assert main(["lint", str(empty)]) == 2
    assert capsys.readouterr().err == f"ggml-rpc lint: error: no TCP connection in {empty}\n"


def test_lint_with_the_port_of_the_capture_still_lints(capsys):
    from ggml_rpc.conformance.sessions.capture import read_connections

    (conn,) = read_connections(FIXTURE)
    assert main(["lint", FIXTURE, "--port", str(conn.server[1])]) == 0
    assert capsys.readouterr().out == f"{FIXTURE}: 0 violation(s)\n"
