"""``ggml-rpc fuzz --workers N [--database DIR|redis://…]``: worker processes sharing one findings set and corpus
through a hypothesis example database, their reports merged into one with each class once.

The Redis test starts Debian's ``redis-server`` on a free loopback port with a temporary folder; it is required
under CI (``.ci/run`` installs it) and skipped elsewhere when the program is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.fuzz.findings import SavedFinding
from ggml_rpc.conformance.fuzz.reports import finding_dict
from ggml_rpc.conformance.fuzz.workers import SharedFindings, campaign_key, merge_reports, open_database
from vulnerable import command as vulnerable


def classes(path: Path) -> list[str]:
    return [c["class"] for c in json.loads(path.read_text())["classes"]]


def finding(tmp_path: Path, kind: str = "crash", command: str = "GET_TENSOR") -> SavedFinding:
    pcap = tmp_path / f"{kind}-{command}.pcap"
    pcap.write_bytes(b"pcap bytes of " + command.encode())
    return SavedFinding(kind, "the target died", command, "bound: tensor.data = 0x1", messages=3, connections=1,
                        pcap=pcap, symptom="SIGABRT", flaw="bound: tensor.data", verified=True)


def test_the_shared_set_holds_each_class_and_its_reproducer(tmp_path):
    db = open_database(str(tmp_path / "db"))
    key = campaign_key("spawned: rpc-server -p {port}", "7.0.0")
    first, second = SharedFindings(db, key, "a/0"), SharedFindings(db, key, "b/0")
    signature = ("crash", "SIGABRT", "GET_TENSOR", "bound: tensor.data")
    assert not second.known(signature)
    saved = finding(tmp_path)
    first.add(signature, saved)
    assert second.known(signature) and not second.known(("crash", "SIGSEGV", "GET_TENSOR", "bound: tensor.data"))
    (record,) = second.records()
    assert record["worker"] == "a/0" and record["finding"]["class"] == saved.class_id
    assert second.corpus() == {saved.class_id: b"pcap bytes of GET_TENSOR"}
    # Another campaign (another server or protocol) shares nothing with this one.
    assert not SharedFindings(db, campaign_key("spawned: rpc-server -p {port}", "8.0.0"), "c/0").known(signature)


def test_merged_reports_hold_each_class_once(tmp_path):
    shared = SharedFindings(open_database(str(tmp_path / "db")), b"k", "elsewhere/0")
    other = finding(tmp_path, command="SET_TENSOR")
    shared.add(("crash", "SIGABRT", "SET_TENSOR", "r"), other)  # found on another machine only
    folders = []
    for n, first_seconds in enumerate((5.0, 2.0)):
        folder = tmp_path / f"worker-{n}"
        folder.mkdir()
        saved = finding(folder)
        entry = dict(finding_dict(saved), first_seconds=first_seconds, hits=2)
        (folder / "findings.json").write_text(json.dumps({"target": "t", "protocol": "7.0.0", "examples": 10,
                                                          "messages": 100, "seconds": 10.0, "restarts": 3,
                                                          "classes": [entry]}))
        folders.append((f"here/{n}", folder))
    record = merge_reports(folders, tmp_path / "merged", shared)
    assert (record["examples"], record["messages"], record["restarts"]) == (20, 200, 6)
    by_class = {c["class"]: c for c in record["classes"]}
    assert len(record["classes"]) == len(by_class) == 2
    mine = by_class[finding(tmp_path).class_id]
    assert (mine["hits"], mine["worker"], mine["first_seconds"]) == (4, "here/1", 2.0)
    theirs = by_class[other.class_id]
    assert theirs["worker"] == "elsewhere/0" and Path(theirs["reproducer"]).read_bytes() == b"pcap bytes of SET_TENSOR"
    assert len((tmp_path / "merged" / "findings.txt").read_text().splitlines()) == 2


def test_workers_hunt_one_spawned_server_each_and_merge(tmp_path, capsys):
    out, sarif = tmp_path / "found", tmp_path / "found.sarif"
    assert main(["fuzz", "--hunt", "--spawn", vulnerable(), "--workers", "2", "--examples", "3", "--seed", "3",
                 "--timeout", "2", "-o", str(out), "--sarif", str(sarif)]) == 1
    text = capsys.readouterr().out
    merged = classes(out / "findings.json")
    assert merged and len(merged) == len(set(merged))
    assert set(merged) == set(classes(out / "worker-0" / "findings.json")) | set(
        classes(out / "worker-1" / "findings.json"))
    record = json.loads((out / "findings.json").read_text())
    assert [w["worker"].rsplit("/", 1)[1] for w in record["workers"]] == ["0", "1"]
    assert all(Path(c["reproducer"]).is_file() for c in record["classes"])
    assert len(json.loads(sarif.read_text())["runs"][0]["results"]) == len(merged)
    assert "2 worker(s)" in text and "each once" in text


@pytest.fixture
def redis_url(tmp_path) -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing (.ci/run installs Debian's redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_machines_share_one_findings_set_through_redis(redis_url, tmp_path, capsys):
    first, second = tmp_path / "machine-1", tmp_path / "machine-2"
    argv = ["fuzz", "--hunt", "--spawn", vulnerable(), "--examples", "3", "--timeout", "2", "--database", redis_url]
    assert main([*argv, "--workers", "2", "--seed", "3", "-o", str(first)]) == 1
    found_first = classes(first / "findings.json")
    assert found_first
    # A second machine (another seed) meets some of the same classes: they come from the set, not shrunk again.
    assert main([*argv, "--seed", "11", "-o", str(second)]) == 1
    capsys.readouterr()
    merged = json.loads((second / "findings.json").read_text())["classes"]
    ids = [c["class"] for c in merged]
    assert len(ids) == len(set(ids)) and set(found_first) <= set(ids)
    for c in merged:
        assert Path(c["reproducer"]).is_file()
    local = classes(second / "worker-0" / "findings.json")
    assert not set(local) & set(found_first), "a class the set already held was saved again"


def test_database_mistakes_are_one_line(capsys):
    assert main(["fuzz", "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    pytest.importorskip("redis")
    assert main(["fuzz", "--examples", "1", "--database", f"redis://127.0.0.1:{port}/0"]) == 2
    err = capsys.readouterr().err
    assert f"--database redis://127.0.0.1:{port}/0" in err and "Traceback" not in err
