"""One convention per kind of option across commands: ``-`` is standard output wherever an output file is taken,
``--json FILE|-``, ``-o/--output`` for the primary output (older spellings kept as aliases), and the same
``--proto`` spellings everywhere."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import COMMANDS, build_parser, main

FIXTURE = str(Path(__file__).resolve().parent.parent / "fixtures" / "v7-inference.pcap")
#: Every spelling of a version the commands accept.
SPELLINGS = ["6", "7", "7.0.1", "8", "6.0.0", "7.0", "8.0.0"]


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(_subparsers(sub, f"{prefix}{name} "))
    return found


PARSERS = _subparsers(build_parser(COMMANDS))


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


@pytest.mark.parametrize("command", sorted(c for c, p in PARSERS.items() if _option(p, "--json")))
def test_every_json_option_takes_a_file_or_dash(command):
    action = _option(PARSERS[command], "--json")
    assert action.nargs is None and action.metavar == "FILE|-", (command, action)


@pytest.mark.parametrize(("command", "aliases"), [
    ("proxy", ["--pcap"]), ("fuzz", ["--out"]), ("pcap record", []), ("dissector", []),
])
def test_the_primary_output_is_dash_o_or_output_with_old_spellings_kept(command, aliases):
    parser = PARSERS[command]
    action = _option(parser, "--output")
    assert action is not None and "-o" in action.option_strings, command
    for alias in aliases:
        assert alias in action.option_strings, (command, alias)


def test_check_json_dash_is_standard_output(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--checks", "HELLO-001", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["verdict"]["state"] == "conformant"
    assert "HELLO-001" in err  # the text report moved to standard error
    assert not (tmp_path / "-").exists()


def test_check_refuses_two_reports_on_standard_output(capsys):
    assert main(["check", "--checks", "HELLO-001", "--json", "-", "--junit", "-"]) == 2
    assert "both name standard output" in capsys.readouterr().err


def test_decode_json_dash_keeps_json_lines_and_json_file_keeps_the_text(capsys, tmp_path):
    assert main(["decode", FIXTURE, "--json", "-"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    target = tmp_path / "d.jsonl"
    assert main(["decode", FIXTURE, "--json", str(target)]) == 0
    assert capsys.readouterr().out.startswith("# connection 0")
    assert target.read_text().splitlines() == lines


def test_lint_json_takes_a_file_or_dash(capsys, tmp_path):
    bad = str(Path(FIXTURE).with_name("v7-cache-flag-abuse.pcap"))
    assert main(["lint", bad, "--json", "-"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records and all(r["file"] == bad for r in records)
    target = tmp_path / "lint.jsonl"
    assert main(["lint", bad, "--json", str(target)]) == 1
    assert "violation(s)" in capsys.readouterr().out
    assert [json.loads(line) for line in target.read_text().splitlines()] == records


def test_json_never_overwrites_a_capture_given_after_the_old_flag(capsys, tmp_path):
    # `lint --json a.pcap b.pcap` was "JSON, two captures"; now a.pcap would be the JSON file: refused.
    assert main(["lint", "--json", FIXTURE, FIXTURE]) == 2
    assert "that is a capture" in capsys.readouterr().err


def test_pcap_record_to_standard_output(capfdbinary):
    assert main(["pcap", "record", "--scenario", "cache-flags", "--proto", "7.0", "-o", "-"]) == 0
    out = capfdbinary.readouterr().out
    assert out[:4] in (b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\xc3\xd4", b"\x0a\x0d\x0d\x0a")


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_command_accepts_the_same_proto_spellings(spelling, tmp_path, capsys):
    assert main(["spec", "--proto", spelling]) == 0
    assert main(["decode", FIXTURE, "--proto", spelling]) in (0, 1)
    assert main(["lint", FIXTURE, "--proto", spelling]) in (0, 1)
    capsys.readouterr()
    for argv in (["replay", FIXTURE, "--as", spelling, "--until-compute"],
                 ["pcap", "record", "--scenario", "cache-flags", "--proto", spelling, "-o", str(tmp_path / "h.pcap")]):
        code = main(argv)
        err = capsys.readouterr().err
        assert "unknown protocol version" not in err and "invalid choice" not in err, (argv, err)
        assert code in (0, 1, 2), argv
