"""The shadow-memory oracle: a planted write past a buffer's end is reported by the hunt (bounded examples, fixed
seed) and by the matching SHADOW check; without the plant, neither reports anything.

The plant (``vulnerable.PLANTED_COPY``) is the reference server with one bug put back through its handler hook: a
COPY_TENSOR whose destination ends exactly at its buffer's end writes 16 bytes more into the next buffer.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from ggml_rpc.conformance.checks import CATALOGUE, by_id
from ggml_rpc.conformance.fuzz import EmbeddedFuzzTarget, Options, fuzz_config
from ggml_rpc.conformance.fuzz.hunt import HUNT_STEPS, embedded_hunt, write_reports
from ggml_rpc.conformance.harness import ExternalTarget, Outcome, Runner
from ggml_rpc.conformance.sessions.replay import replay
from ggml_rpc.reference import make_config, running_server
from ggml_rpc.spec import V6, V7, V8, Protocol
from hunting import run_clean
from vulnerable import PLANTED_BYTES, PlantedServer

#: The hunt's bound: the plant must be reported within this many examples (seed 1 finds it in the 5th).
PLANT_EXAMPLES = 40
#: Examples of the clean hunts (the 6.0.0 and 7.0.0 ones are test_fuzz_hunt's, with the oracle on as by default).
CLEAN_EXAMPLES = 20
SHADOW = [c for c in CATALOGUE if c.id.startswith("SHADOW-")]


@pytest.fixture(scope="module")
def planted_hunt(tmp_path_factory):
    out = tmp_path_factory.mktemp("planted")
    hunt = embedded_hunt(V7, Options(examples=PLANT_EXAMPLES, seed=1, out_dir=out, timeout=2.0, steps=HUNT_STEPS,
                                     max_findings=1), server_cls=PlantedServer)
    hunt.target.start()
    try:
        hunt.run()
    finally:
        hunt.target.stop()
    write_reports(hunt, out, out / "findings.sarif")
    return hunt, out


def test_the_hunt_reports_the_planted_write_as_a_verified_corruption(planted_hunt) -> None:
    hunt, _ = planted_hunt
    assert hunt.stopped_because == "1 finding(s)" and hunt.stats.examples <= PLANT_EXAMPLES
    (f,) = hunt.findings
    assert (f.kind, f.command) == ("corruption", "COPY_TENSOR"), f.line()
    # Named by where the bytes changed and by the written tensor's place: the destination ends at its buffer's end.
    assert f.symptom == "another buffer than the destination's; at-end", f.symptom
    # The next buffer's first bytes: a sentinel's, or another buffer the example allocated after the destination's.
    assert re.search(r"buffer #\d+ \(\d+ bytes", f.message) and "at [0, " in f.message, f.message
    assert f.verified is True and f.pcap is not None and f.pcap.exists()
    assert f.messages <= 16  # HELLO, three buffers and their canaries, the copy, the reads


def test_the_reproducer_replays_clean_on_the_reference_and_fails_the_plant(planted_hunt) -> None:
    hunt, _ = planted_hunt
    (f,) = hunt.findings
    with running_server("7") as srv:
        report = replay([f.pcap], srv.host, srv.port, timeout=10)
        assert report.ok, [m.line() for m in report.mismatches]
    target = EmbeddedFuzzTarget(fuzz_config(V7), PlantedServer, cache=False)
    target.start()
    try:
        report = replay([f.pcap], target.host, target.port, timeout=10)
    finally:
        target.stop()
    assert not report.ok
    assert {m.command for m in report.mismatches} <= {"GET_TENSOR", "GET_TENSOR_2D"}


def test_the_corruption_is_in_findings_json_and_sarif(planted_hunt) -> None:
    hunt, out = planted_hunt
    data = json.loads((out / "findings.json").read_text())
    assert data["shadow_reads"] > 0
    assert [c["kind"] for c in data["classes"]] == ["corruption"]
    sarif = json.loads((out / "findings.sarif").read_text())
    (run,) = sarif["runs"]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == [hunt.findings[0].class_id]
    assert hunt.findings[0].class_id.startswith("corruption/")


@pytest.mark.parametrize("protocol", [V8], ids=["8"])
def test_without_the_plant_the_hunt_reports_nothing_and_the_oracle_ran(protocol: Protocol, tmp_path) -> None:
    hunt = embedded_hunt(protocol, Options(examples=CLEAN_EXAMPLES, seed=1, out_dir=tmp_path, timeout=2.0,
                                           steps=HUNT_STEPS))
    run_clean(hunt)
    assert hunt.stats.shadow_reads > CLEAN_EXAMPLES  # the oracle read back after the writes


@contextmanager
def _planted(protocol: Protocol) -> Iterator[tuple[str, int]]:
    server = PlantedServer(make_config(protocol), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.port
    finally:
        server.stop()
        thread.join(5)


def _run(check_ids: list[str], host: str, port: int, protocol: Protocol) -> dict:
    runner = Runner(ExternalTarget(host, port), expect=protocol, timeout=3.0, probe_timeout=2.0)
    runner.start()
    try:
        return {cid: runner.run_one(by_id(cid)) for cid in check_ids}
    finally:
        runner.stop()


def test_the_matching_check_fails_the_plant_with_evidence_and_the_others_pass() -> None:
    with _planted(V7) as (host, port):
        results = _run([c.id for c in SHADOW if c.applies_to(V7.version)], host, port, V7)
    copy_edges = results.pop("SHADOW-009")
    assert copy_edges.outcome is Outcome.FAIL, copy_edges.message
    assert "sentinel after the working buffer" in copy_edges.message and "at-end" in copy_edges.message
    assert f"{PLANTED_BYTES} byte(s)" in copy_edges.message or "byte(s) at offsets [0, " in copy_edges.message
    assert any(e.expected and e.got for e in copy_edges.evidence)
    # Only copies that end at their buffer's end are planted: besides the COPY_TENSOR checks whose cases end there
    # (edges; shapes, placed at the end too), every SHADOW check of 7.0.0 passes.
    failed = {cid for cid, r in results.items() if r.outcome is not Outcome.PASS}
    assert failed <= {"SHADOW-010"}, {cid: results[cid].message for cid in failed}


@pytest.mark.parametrize("protocol", [V6, V7, V8], ids=["6", "7", "8"])
def test_every_shadow_check_passes_against_the_reference(protocol: Protocol, tmp_path) -> None:
    with running_server(protocol, cache_dir=str(tmp_path / "cache")) as srv:
        ids = [c.id for c in SHADOW if c.applies_to(protocol.version)]
        results = _run(ids, srv.host, srv.port, protocol)
    assert {cid: (r.outcome.value, r.message) for cid, r in results.items() if r.outcome is not Outcome.PASS} == {}
    assert len(results) == len(ids) >= 18
