"""The campaign mode for a target that dies often (``--hunt``): bounded by examples and seeded, never by time.

Against a server with one of upstream's bugs re-enabled (tests/fuzz/vulnerable.py) it keeps going after each death,
shrinks the class to a reproducer that kills a fresh target again, and writes findings.json and SARIF 2.1.0; against the
reference it finds nothing.
"""

from __future__ import annotations

import json

import pytest
from ggml_rpc.conformance.checks._leaks import classify
from ggml_rpc.conformance.fuzz import EmbeddedFuzzTarget, Options, fuzz_config
from ggml_rpc.conformance.fuzz.findings import FuzzFinding, death_symptom, flaw_class
from ggml_rpc.conformance.fuzz.hunt import HUNT_STEPS, embedded_hunt, write_reports
from ggml_rpc.conformance.sessions.replay import ReplayError, replay
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V6, V7
from hunting import run_clean
from vulnerable import VulnerableServer

EXAMPLES = 40


@pytest.fixture(scope="module")
def vulnerable_hunt(tmp_path_factory):
    out = tmp_path_factory.mktemp("hunt")
    hunt = embedded_hunt(V7, Options(examples=EXAMPLES, seed=3, out_dir=out, timeout=2.0, steps=HUNT_STEPS),
                         server_cls=VulnerableServer)
    hunt.target.start()
    try:
        hunt.run()
    finally:
        hunt.target.stop()
    write_reports(hunt, out, out / "findings.sarif")
    return hunt, out


def test_keeps_going_after_deaths_and_keeps_one_reproducer_per_class(vulnerable_hunt):
    hunt, _ = vulnerable_hunt
    assert hunt.stopped_because == "budget spent" and hunt.stats.examples == EXAMPLES
    crashes = [f for f in hunt.findings if f.kind == "crash"]
    assert crashes, [f.line() for f in hunt.findings]
    # More deaths than classes: the campaign went on after each, and repeated classes were not saved again.
    assert hunt.hunt.findings_seen > len(hunt.findings) and hunt.stats.restarts > len(crashes)
    assert len({f.class_id for f in hunt.findings}) == len(hunt.findings)
    for f in crashes:
        # The one bug of the variant: a tensor outside its buffer (an address out of bounds, a handle naming
        # another buffer than the one the address lies in, or a size past 2^64 that wraps to a small one).
        assert f.symptom.startswith("SIGABRT") and f.flaw.startswith(("bound: ", "id: ", "arith: ")), f.line()
        assert f.verified is True and f.pcap is not None and f.pcap.exists()
        assert f.messages <= 6  # HELLO, ALLOC_BUFFER, BUFFER_GET_BASE and the fatal request, about
    assert not [f.line() for f in hunt.findings if f.kind != "crash"]


def test_each_reproducer_kills_a_fresh_vulnerable_server_and_replays_clean_on_the_reference(vulnerable_hunt):
    hunt, _ = vulnerable_hunt
    for f in hunt.findings:
        with running_server("7") as srv:
            report = replay([f.pcap], srv.host, srv.port, timeout=10)
            assert report.ok, [m.line() for m in report.mismatches]
        target = EmbeddedFuzzTarget(fuzz_config(V7), VulnerableServer, cache=False)
        target.start()
        try:
            try:
                report = replay([f.pcap], target.host, target.port, timeout=10)
            except ReplayError as exc:
                assert "cannot connect" in str(exc)
            else:
                assert not report.ok
            info = target.death_info()
            assert info is not None and "SIGABRT" in info["status"]
        finally:
            target.stop()


def test_findings_json_and_sarif(vulnerable_hunt):
    hunt, out = vulnerable_hunt
    data = json.loads((out / "findings.json").read_text())
    assert data["examples"] == EXAMPLES and len(data["classes"]) == len(hunt.findings)
    for c in data["classes"]:
        assert c["reproducer_bytes"] > 0 and c["first_seconds"] >= 0 and c["hits"] >= 1
    sarif = json.loads((out / "findings.sarif").read_text())
    assert sarif["version"] == "2.1.0" and sarif["$schema"].endswith("sarif-2.1.0.json")
    (run,) = sarif["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [f.class_id for f in hunt.findings]
    assert len(run["results"]) == len(hunt.findings)
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        loc = result["locations"][0]["physicalLocation"]["artifactLocation"]
        artifact = run["artifacts"][loc["index"]]
        assert artifact["location"]["uri"] == loc["uri"] and loc["uri"].endswith(".pcap")
        assert len(artifact["hashes"]["sha-256"]) == 64 and artifact["length"] > 0
    assert run["originalUriBaseIds"]["FINDINGS"]["uri"].startswith("file://")


@pytest.mark.parametrize("protocol", [V7, V6], ids=["7", "6"])
def test_the_reference_survives_the_hunt(protocol, tmp_path):
    hunt = embedded_hunt(protocol, Options(examples=EXAMPLES, seed=11, out_dir=tmp_path, timeout=2.0,
                                           steps=HUNT_STEPS))
    run_clean(hunt)
    st = hunt.stats
    assert st.messages > EXAMPLES * 5
    # The strategies ran: size headers of 2^63, region edges, the other layout, early closes, fresh reads.
    assert {"size", "bound", "layout", "early-close"} <= set(st.by_flaw)


def test_classes_split_by_signal_assertion_and_rule_not_by_command_alone() -> None:
    def crash(broken: str, status: str, log: str = "") -> FuzzFinding:
        f = FuzzFinding("crash", "died", command="GET_TENSOR", broken=broken)
        f.death = {"status": f"killed by signal {status}", "log_tail": [log] if log else []}
        return f

    a = crash("bound: tensor.data = 0x7f01", "SIGABRT", "/x/ggml-rpc.cpp:1416: GGML_ASSERT(data + nbytes) failed")
    b = crash("bound: tensor.data = 0x7f99", "SIGABRT", "/x/ggml-rpc.cpp:1416: GGML_ASSERT(data + nbytes) failed")
    c = crash("bound: size = 0x11", "SIGABRT", "/y/ggml-backend.cpp:500: GGML_ASSERT(offset + size) failed")
    d = crash("bound: tensor.data = 0x7f01", "SIGSEGV")
    assert a.signature == b.signature  # the drawn value is not part of the class
    assert len({a.signature, c.signature, d.signature}) == 3
    assert death_symptom(a.death) == "SIGABRT ggml-rpc.cpp:1416"
    assert flaw_class("bound: tensors.12.src.3 = 0x0") == "bound: tensors.*.src.*"
    assert flaw_class(f"size: header claims {1 << 63} bytes") == "size: claim >= 2^63"
    assert flaw_class("size: header claims 4100 bytes") == "size: small claim"
    assert flaw_class(None) == "valid"
    leak = FuzzFinding("info-leak", "leaked", command="GET_TENSOR")
    leak.symptom = classify((0x7FAB_F11F_1CC0).to_bytes(8, "little") * 4).symptom
    assert leak.signature == ("info-leak", "pointers", "GET_TENSOR", "valid")
