"""The ``ggml-rpc`` entry imports a sub-command's module only when that command runs, and still shows every
command's options in its help."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from ggml_rpc.conformance.cli import COMMANDS, main

#: Prints the modules of interest imported by running the CLI with the given arguments (help exits through
#: SystemExit), as JSON on standard error.
PROBE = """
import json, sys
from ggml_rpc.conformance.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("ggml_rpc", "numpy", "rich", "construct", "scapy", "dpkt", "hypothesis")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)), file=sys.stderr)
"""


def imported_by(*argv: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_the_top_level_imports_no_command_and_nothing_heavy(argv):
    assert imported_by(*argv) == {"ggml_rpc", "ggml_rpc.conformance", "ggml_rpc.conformance.cli",
                                  "ggml_rpc.conformance.cli.interrupts", "ggml_rpc.conformance.cli.options"}


def test_a_command_imports_its_own_module_only():
    cli_modules = {m for m in imported_by("spec", "--help") if m.startswith("ggml_rpc.conformance.cli.")}
    assert cli_modules == {"ggml_rpc.conformance.cli.interrupts", "ggml_rpc.conformance.cli.options",
                           "ggml_rpc.conformance.cli.spec"}


def test_every_command_is_listed_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help column
    for name, help_text in COMMANDS.items():
        assert f"{name} {' '.join(help_text.split())}" in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_module_builds_its_parser(capsys, name):
    module = importlib.import_module(f"ggml_rpc.conformance.cli.{name}")
    assert callable(module.add_arguments)
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ggml-rpc {name} ")
    assert "-h, --help" in out


def test_options_of_the_command_are_those_it_defines(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    for option in ("--server", "--spawn", "--proto", "--checks", "--strict", "--json", "--junit", "--list"):
        assert option in out


def test_version(capsys):
    from ggml_rpc.conformance import kit_version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"ggml-rpc-kit {kit_version()}\n"


def test_an_unknown_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["chek"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'chek'" in err[0]
