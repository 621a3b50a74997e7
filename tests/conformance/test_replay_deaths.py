"""Replay that reproduces: a check's own pcap replayed against a server that dies of it must say that it
died (exit 1), never "0 mismatch(es)" with exit 0, and a target that stops accepting mid-replay is reported as
such, not as "cannot connect" (a usage error, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty import Dies, faulty_server
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness import free_port, wait_for_port
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7, Command

FRAGILE = Path(__file__).resolve().parent / "fragile_server.py"


@pytest.fixture(scope="module")
def frame_031_pcap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FRAME-031's exchange (a GRAPH_COMPUTE with a null node) recorded against the reference server."""
    out = tmp_path_factory.mktemp("pcaps")
    assert main(["check", "--checks", "FRAME-031", "--pcap-dir", str(out), "--pcap-all"]) == 0
    return out / "FRAME-031.pcap"


@pytest.fixture
def fragile() -> Iterator[int]:
    """A server that aborts (SIGABRT) on a GRAPH_COMPUTE holding a null node; its port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FRAGILE), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", port, 20.0, lambda: proc.poll() is None)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_replay_that_kills_the_server_says_so(frame_031_pcap: Path, fragile: int,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(frame_031_pcap), "--server", f"127.0.0.1:{fragile}", "--timeout", "5"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DIED: the server stopped accepting connections after message" in out
    # The last message sent is the probe after the null-node graph; the last answered one came before the graph.
    assert "of connection 0 of" in out and "(last reply: message 2, BUFFER_GET_BASE)" in out
    assert "0 mismatch(es), and the server died" in out


def test_a_server_that_stops_accepting_mid_replay_is_reported_with_exit_1(
        frame_031_pcap: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The relay closes its listener (then every connection) on the GRAPH_COMPUTE: the second connection is refused.
    dies = Dies(lambda conn, msg: msg.cmd == Command.GRAPH_COMPUTE)
    with running_server("7") as ref, faulty_server(ref.address, V7, dies) as bad:
        code = main(["replay", str(frame_031_pcap), str(frame_031_pcap), "--server", f"127.0.0.1:{bad.port}",
                     "--json", "-"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "cannot connect" not in captured.err
    assert "DIED: the server stopped accepting connections after message 4 (DEVICE_COUNT) of connection 0" \
        in captured.err
    assert ": connect: Connection refused" in captured.err and "replayed 1 connection(s)" in captured.err
    report = json.loads(captured.out)
    assert report["ok"] is False and [m["kind"] for m in report["mismatches"]] == ["death"]


def test_a_replay_against_a_healthy_server_still_passes(frame_031_pcap: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(frame_031_pcap), str(frame_031_pcap)]) == 0
    assert "0 mismatch(es)\n" in capsys.readouterr().out
