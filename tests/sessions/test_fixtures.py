"""fixtures/: every recorded session is listed in the manifest, reads cleanly, lints as declared, and replays with
0 mismatches against the reference server of its version and, rewritten with --as, of the other one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.scenarios import SCENARIOS

from .conftest import tshark_problems

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ENTRIES = {e["file"]: e for e in MANIFEST["fixtures"]}


def test_manifest_and_directory_agree():
    assert set(ENTRIES) == {p.name for p in FIXTURES.glob("*.pcap")}
    for sc in SCENARIOS.values():
        for major in sc.majors:
            assert f"v{major}-{sc.name}.pcap" in ENTRIES
    assert sum((FIXTURES / f).stat().st_size for f in ENTRIES) < 2 << 20  # the repo stays small


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_fixture_reads_cleanly(name):
    entry = ENTRIES[name]
    decoded = decode_file(FIXTURES / name, validate=False)
    assert len(decoded) == entry["connections"]
    assert {dc.protocol.label for dc in decoded if dc.protocol is not None} == {entry["protocol"]}
    assert tshark_problems(FIXTURES / name) == ""


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_fixture_lints_as_declared(name):
    violations = lint_file(FIXTURES / name)
    if ENTRIES[name]["lint_clean"]:
        assert violations == []
    else:
        assert violations


def test_the_planted_cache_flag_violations_are_found(capsys):
    violations = lint_file(FIXTURES / "v7-cache-flag-abuse.pcap")
    assert [v.rule for v in violations] == ["CACHE-FLAG-NO-MISS", "CACHE-FLAG-HASH", "CACHE-FLAG-MISSING"]
    assert [v.index for v in violations] == [3, 5, 7]
    assert main(["lint", str(FIXTURES / "v7-cache-flag-abuse.pcap")]) == 1
    assert "3 violation(s): CACHE-FLAG-HASH 1, CACHE-FLAG-MISSING 1, CACHE-FLAG-NO-MISS 1" in capsys.readouterr().out


def test_bad_input_violations_name_each_rule():
    rules = Counter(v.rule for v in lint_file(FIXTURES / "v7-bad-input.pcap"))
    assert rules == {"DECODE": 5, "TENSOR-TYPE": 1, "GRAPH-NODE-UNKNOWN": 1}


@pytest.mark.parametrize("as_other", [False, True], ids=["own-version", "as-other-version"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_fixture_replays_without_mismatch(name, as_other, capsys):
    major = ENTRIES[name]["protocol"][0]
    args = ["replay", str(FIXTURES / name)]
    if as_other:
        args += ["--as", {"6": "7", "7": "6", "8": "7"}[major]]
        if ENTRIES[name]["scenario"] == "rows-and-uids":  # 2-D transfers have no 7.0 equivalent: refused
            assert main(args) == 2
            assert "SET_TENSOR_2D of 8.0.0 has no equivalent in 7.0.0" in capsys.readouterr().err
            return
    code = main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 mismatch(es)" in out


def test_cold_then_warm_model_load(capsys):
    """v7: the warm connection hits; replayed --as 6 the replayer must supply the data (a v6 server does not
    cache 64 KiB) and says so."""
    assert main(["replay", "--as", "6", str(FIXTURES / "v7-model-load.pcap")]) == 0
    out = capsys.readouterr().out
    assert "that the target cannot hold yet; sent its 65536 bytes" in out


@pytest.mark.parametrize("proto", ["6", "7"])
def test_model_load_above_the_hash_threshold_hits_warm_in_both_versions(tmp_path, proto, capsys):
    """With a weight above 10 MiB (what upstream clients hash) a v6 server caches it too: the warm connection hits;
    the recording replays clean in its version and --as the other."""
    out = tmp_path / "big.pcap"
    assert main(["pcap", "record", "--scenario", "model-load", "--proto", proto, "-o", str(out),
                 "--hash-weight-bytes", str(10 * 1024 * 1024 + 4096)]) == 0
    assert "warm connection: output.weight hash hit" in capsys.readouterr().out
    assert lint_file(out) == []
    assert main(["replay", str(out)]) == 0
    assert main(["replay", str(out), "--as", "7" if proto == "6" else "6"]) == 0


@pytest.mark.parametrize("target", ["6", "7"])
def test_captures_of_both_versions_replay_together_with_as(target, capsys):
    files = [str(FIXTURES / "v6-cache-flags.pcap"), str(FIXTURES / "v7-cache-flags.pcap")]
    assert main(["replay", *files]) == 2  # one server cannot speak both: --as is needed
    capsys.readouterr()
    assert main(["replay", "--as", target, *files]) == 0
    out = capsys.readouterr().out
    assert "(6.0.0/7.0.0 as " in out and "0 mismatch(es)" in out
