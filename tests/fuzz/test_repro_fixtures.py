"""The checked-in reproducers of upstream's death classes (``fixtures/repro/``), found by ``ggml-rpc fuzz --hunt``.

Each replays clean against the reference server (it must not harm it: the replies in the pcap are the reference's
own), and, with the upstream peers installed, kills a fresh upstream ``rpc-server`` of its version with the
recorded signal.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.sessions.replay import ReplayError, replay
from ggml_rpc.reference import running_server

REPRO = Path(__file__).resolve().parents[2] / "fixtures" / "repro"
MANIFEST = json.loads((REPRO / "manifest.json").read_text())["reproducers"]
IDS = [r["file"] for r in MANIFEST]


def test_manifest_lists_every_reproducer_and_each_is_small() -> None:
    assert sorted(r["file"] for r in MANIFEST) == sorted(p.name for p in REPRO.glob("*.pcap"))
    assert len(MANIFEST) >= 10
    for r in MANIFEST:
        assert (REPRO / r["file"]).stat().st_size <= 16 << 10


@pytest.mark.parametrize("repro", MANIFEST, ids=IDS)
def test_replays_clean_against_the_reference(repro: dict) -> None:
    with running_server(str(repro["major"])) as srv:
        report = replay([REPRO / repro["file"]], srv.host, srv.port, timeout=10)
        assert report.ok, [m.line() for m in report.mismatches]
        with RpcClient.connect(srv.host, srv.port, timeout=5) as c:  # unharmed: still serving
            assert c.device_count() >= 1


@pytest.mark.upstream
@pytest.mark.parametrize("repro", MANIFEST, ids=IDS)
def test_kills_a_fresh_upstream_server(repro: dict) -> None:
    from ggml_rpc.conformance.upstream.peers import PEERS
    from ggml_rpc.conformance.upstream.runs import UpstreamServer

    peer = PEERS[repro["version"]]
    if not peer.installed():
        message = f"upstream {repro['version']} not installed: run `ggml-rpc upstream install`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    if "tries" in repro:
        codes = _race(peer, repro)
    else:
        with UpstreamServer(peer, cache=False) as server:
            try:
                replay([REPRO / repro["file"]], "127.0.0.1", server.port, timeout=10)
            except ReplayError:
                pass  # the probe connection after the fatal request is refused: the server is gone
            assert server.proc is not None
            codes = [server.proc.wait(timeout=10)]
    assert codes[-1] == -getattr(signal, repro["signal"]), f"{repro['file']}: exit codes {codes}"


def _race(peer, repro: dict) -> list[int | None]:
    """A reproducer of a client that leaves before its reply against up to ``tries`` fresh servers; the exit code
    of each (None: it lived).  Replay sends the last request's bytes with the client's FIN (TCP_CORK), which made
    the death deterministic (10 of 10, log to a pipe or to /dev/null; 7 of 12 and 0 of 8 before); the tries stay as a
    margin for a platform without TCP_CORK."""
    import tempfile

    from ggml_rpc.conformance.harness import SpawnedTarget
    from ggml_rpc.conformance.upstream.runs import UpstreamServer

    codes: list[int | None] = []
    with tempfile.TemporaryDirectory(prefix="ggml-rpc-llama-cache-") as cache:
        command = UpstreamServer(peer, cache=False, llama_cache=Path(cache)).spawn_command()
        for _ in range(repro["tries"]):
            target = SpawnedTarget(command)
            target.start()
            try:
                try:
                    replay([REPRO / repro["file"]], "127.0.0.1", target.port, timeout=10)
                except ReplayError:
                    pass
                info = target.death_info() if not _serves(target.port) else None
            finally:
                target.stop()
            codes.append(info.get("exit_code") if info else None)
            if codes[-1] is not None:
                break
    return codes


def _serves(port: int) -> bool:
    try:
        with RpcClient.connect("127.0.0.1", port, timeout=5) as c:
            return c.device_count() >= 1
    except (OSError, ConnectionClosed):
        return False
