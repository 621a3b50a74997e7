"""``ggml-rpc replay --spawn CMD``: the replayer starts the target, restarts it after each death, and attributes
every death (signal, connection, the message sent last and those since the last reply was due)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main

HERE = Path(__file__).resolve().parent
FRAGILE = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fragile_server.py'))} --port {{port}}"
FIXTURES = HERE.parents[1] / "fixtures"


@pytest.fixture(scope="module")
def frame_031_pcap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FRAME-031's exchange (a GRAPH_COMPUTE with a null node) recorded against the reference server."""
    out = tmp_path_factory.mktemp("pcaps")
    assert main(["check", "--checks", "FRAME-031", "--pcap-dir", str(out), "--pcap-all"]) == 0
    return out / "FRAME-031.pcap"


def test_every_death_is_attributed_and_the_replay_goes_on(frame_031_pcap, capsys):
    pcap = str(frame_031_pcap)
    code = main(["replay", pcap, pcap, "--spawn", FRAGILE, "--timeout", "5", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    report = json.loads(captured.out)
    deaths = [m for m in report["mismatches"] if m["kind"] == "death"]
    assert len(deaths) == 2  # one per copy: the server was restarted and the second copy replayed too
    for d in deaths:
        assert d["file"] == pcap and d["connection"] == 0
        assert "killed by signal SIGABRT" in d["got"]
        assert "sent since the last reply was due: 3 GRAPH_COMPUTE" in d["got"]
        assert "fatal: GRAPH_COMPUTE with a null node" in d["got"]  # the server's own last words
    assert report["connections"] == 2
    assert "2 restart(s)" in report["target"]
    assert "the server died 2 times" in captured.err


def test_a_server_that_survives_is_not_restarted(tmp_path, capsys):
    pcap = str(FIXTURES / "v7-model-load.pcap")
    serve = (f"{shlex.quote(sys.executable)} -m ggml_rpc.conformance.cli serve --proto 7 --port {{port}} "
             f"--cache-dir {shlex.quote(str(tmp_path))}")
    assert main(["replay", pcap, "--spawn", serve]) == 0
    out = capsys.readouterr().out
    assert "0 restart(s)" in out and "0 mismatch(es)" in out


def test_spawn_needs_a_port(capsys):
    assert main(["replay", str(FIXTURES / "v7-model-load.pcap"), "--spawn", "true"]) == 2
    assert "{port}" in capsys.readouterr().err
