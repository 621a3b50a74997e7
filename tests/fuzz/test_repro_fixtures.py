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
from ggml_rpc.conformance.client import RpcClient
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
    with UpstreamServer(peer, cache=False) as server:
        try:
            replay([REPRO / repro["file"]], "127.0.0.1", server.port, timeout=10)
        except ReplayError:
            pass  # the probe connection after the fatal request is refused: the server is gone
        assert server.proc is not None
        code = server.proc.wait(timeout=10)
        assert code == -getattr(signal, repro["signal"]), f"{repro['file']}: exit code {code}"
