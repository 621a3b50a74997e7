"""The CLI entry points: the console script's module run with -m, and serve --list-ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ggml_rpc.conformance.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_module_entry_reports_usage_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ggml_rpc.conformance.cli", "decode", str(tmp_path / "missing.pcap")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ggml-rpc decode: error: cannot open {tmp_path / 'missing.pcap'}: No such file or directory"
    ]


def test_serve_list_ops_prints_the_checked_in_table(capsys):
    assert main(["serve", "--list-ops"]) == 0
    assert capsys.readouterr().out == (ROOT / "reference" / "OPS.md").read_text()
