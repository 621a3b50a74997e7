"""The checks for upstream's known death and leak classes (SECURITY.md), against genuine upstream builds.

Each of FRAME-036..040 and DATA-030 must find exactly what upstream 6.0.0/7.0.0 were seen to do: a death named by its
signal (a failure at the check's own level, and a run that is not conformant) or, for DATA-030, pointer-like bytes
of other allocations.  The
reference server passes all of them (tests/conformance/test_check_cli.py runs the whole catalogue against it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ggml_rpc.conformance.upstream.peers import PEERS, Peer
from ggml_rpc.conformance.upstream.runs import UpstreamServer, kit

CHECKS = "FRAME-036,FRAME-037,FRAME-038,FRAME-039,FRAME-040,DATA-030"
#: What each check reports against each major: the signal of the death, "leak", or "pass".
EXPECTED = {
    6: {"FRAME-036": "SIGABRT", "FRAME-037": "SIGABRT", "FRAME-038": "SIGSEGV", "FRAME-039": "SIGPIPE",
        "FRAME-040": "SIGABRT", "DATA-030": "leak"},
    # A v6-layout SET_TENSOR reads as an offset far outside the buffer on v7: a clean close.
    7: {"FRAME-036": "SIGABRT", "FRAME-037": "SIGABRT", "FRAME-038": "SIGSEGV", "FRAME-039": "SIGPIPE",
        "FRAME-040": "pass", "DATA-030": "leak"},
}


def peer(version: str) -> Peer:
    p = PEERS[version]
    if not p.installed():
        message = f"upstream {version} not installed: run `ggml-rpc upstream install`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return p


def verdict(result: dict) -> str:
    if result["outcome"] == "pass":
        return "pass"
    death = result["server_death"]
    if death:
        return death["status"].rsplit(" ", 1)[-1]
    leaked = "pointers:" in result["message"] or "freed-data:" in result["message"]
    return "leak" if leaked else f"fail: {result['message']}"


@pytest.mark.upstream
@pytest.mark.parametrize("version", ["6.0.0", "7.0.0"])
def test_new_checks_find_upstreams_death_and_leak_classes(version: str, tmp_path: Path) -> None:
    p = peer(version)
    server = UpstreamServer(p, cache=True, llama_cache=tmp_path)
    server.cache_dir.mkdir(parents=True)
    out = tmp_path / "check.json"
    done = kit("check", "--spawn", server.spawn_command(), "--checks", CHECKS, "--json", str(out))
    report = json.loads(out.read_text())
    # Deaths are never conformant (exit 1), and each is counted on the verdict line.
    assert done.code == 1 and report["verdict"]["state"] == "not conformant", done.why()
    results = {r["id"]: r for r in report["results"]}
    assert {cid: verdict(r) for cid, r in results.items()} == EXPECTED[p.major]
    deaths = sum(1 for v in EXPECTED[p.major].values() if v.startswith("SIG"))
    assert report["verdict"]["deaths"] == deaths and report["verdict"]["leaks"] == 1
    for r in results.values():
        if r["outcome"] != "pass":
            assert r["failed_level"] == r["level"]
    leak = results["DATA-030"]["evidence"][-1]["got"]
    assert "freed buffer's fill" in leak or "addresses" in leak
