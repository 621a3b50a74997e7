"""User mistakes on every command: one clear line on stderr naming the problem, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main

FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "v7-inference.pcap")


def usage_error(capsys, argv: list[str]) -> str:
    """Run the CLI, require exit code 2 and exactly one line on stderr; return that line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ggml-rpc {argv[0]}: error: ")
    return lines[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["replay", FIXTURE, "--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: no such directory"),
    (["replay", FIXTURE, "--nmse", "-1"], "--nmse must be a non-negative number"),
    (["replay", FIXTURE, "--nmse", "nan"], "--nmse must be a non-negative number"),
    (["replay", FIXTURE, "--timeout", "0"], "--timeout must be positive"),
    (["replay", FIXTURE, "--server", "127.0.0.1:1"], "cannot connect to 127.0.0.1:1: Connection refused"),
    (["replay", FIXTURE, "--server", "nowhere"], "--server: expected HOST:PORT, got 'nowhere'"),
    (["check", "--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: no such directory"),
    (["check", "--junit", "/"], "--junit /: is a directory"),
])
def test_replay_and_check_options(capsys, argv, expected):
    assert expected in usage_error(capsys, argv)


def test_replay_json_is_written(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["replay", FIXTURE, "--json", str(out)]) == 0
    assert '"ok": true' in out.read_text()
    assert "0 mismatch(es)" in capsys.readouterr().out
