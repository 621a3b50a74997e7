"""``ggml-rpc bench``: the command BENCHMARKS.md gives runs, targets are compared side by side, failures are reported.

The figures themselves are not checked (they depend on the machine); what is checked is that every figure is taken,
on every target, with the statistics, ratios and JSON record the documentation describes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ggml_rpc.bench.kit import make_session
from ggml_rpc.bench.runner import Figure, Measurement, NotApplicable, SampleStats, run_measurement
from ggml_rpc.bench.server_figures import (
    CHAIN_ID_BASE,
    CHAIN_ID_STRIDE,
    BenchTarget,
    GraphCompute,
    chain_graph,
)
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.cli.bench import QUICK
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V6, V7, Command, RequestDecoder, encode_request
from upstream_captures import captures

ROOT = Path(__file__).resolve().parent.parent
SERVER_KEYS = ["set_tensor_4KiB", "set_tensor_1MiB", "set_tensor_16MiB", "get_tensor_4KiB", "get_tensor_1MiB",
               "get_tensor_16MiB", "round_trips_1cpu", "round_trips_2cpu", f"graph_compute_{QUICK.graph_tensors}",
               "set_tensor_hash_hit",
               "replay"]


def documented_quick_commands() -> list[str]:
    """Every ``ggml-rpc bench ... --quick ...`` line inside a fenced block of BENCHMARKS.md."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip().startswith("ggml-rpc bench") and "--quick" in line]


def run_bench(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    code = main(["bench", *argv, "--json", str(out)])
    capsys.readouterr()
    return code, json.loads(out.read_text())


def by_key(doc: dict[str, Any], section: str = "server_figures") -> dict[str, dict[str, Any]]:
    return {f["key"]: f for f in doc[section]}


def test_the_quick_command_in_benchmarks_md_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commands = documented_quick_commands()
    assert commands, "BENCHMARKS.md gives no `ggml-rpc bench --quick` command"
    for command in commands:
        # The reference server alone (an installed upstream would be added by default: its own test is below).
        argv = [*shlex.split(command)[2:], "--no-upstream"]
        code, doc = run_bench(argv, tmp_path, capsys)
        assert code == 0, command
        assert doc["schema"] == 2 and doc["quick"] is True
        assert [t["name"] for t in doc["targets"]] == ["reference"]
        assert doc["targets"][0]["version"] == "7.0.0"
        figures = by_key(doc)
        assert list(figures) == SERVER_KEYS
        for f in figures.values():
            (r,) = f["results"]
            if f["key"] == "round_trips_2cpu" and len(os.sched_getaffinity(0)) < 2:
                assert "CPU" in r["not_applicable"]  # a placement this machine cannot give
                continue
            assert r["error"] is None and r["not_applicable"] is None, (f["key"], r)
            assert len(r["samples"]) == doc["repeat"] and r["median"] > 0 and r["ratio"] == 1.0
            assert r["min"] <= r["median"] <= r["max"]
        assert list(by_key(doc, "kit_figures")) == ["pcap_write", f"graph_decode_{QUICK.graph_tensors}", "pcap_decode"]
        assert doc["bulk_comparisons"] == []  # nothing to compare the reference with
        assert by_key(doc)["round_trips_1cpu"]["goal"]["source"] == "BENCHMARKS.md: reference server"


@pytest.mark.upstream
def test_the_installed_upstream_is_compared_with_by_default(upstream_peer, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_bench(["--quick", "--repeat", "1", "--no-kit"], tmp_path, capsys)
    assert code == 0
    assert [t["name"] for t in doc["targets"]] == ["reference", "upstream"]
    assert doc["targets"][1]["version"] == "7.0.0"
    hit = by_key(doc)["set_tensor_hash_hit"]["results"]
    assert all(r["error"] is None and r["median"] > 0 for r in hit)  # upstream runs with -c
    assert doc["generation"] == []  # --quick: no generation figure


def test_second_server_is_measured_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A protocol 6 server without a cache: its version is learnt from HELLO, the v6 layouts are used, the replay
    # is translated to v6, and the hash figure is n/a with the reason.
    with running_server("6") as other:
        code, doc = run_bench(["--quick", "--repeat", "2", "--server", f"v6={other.host}:{other.port}"],
                              tmp_path, capsys)
    assert code == 0
    assert [(t["name"], t["version"]) for t in doc["targets"]] == [("reference", "7.0.0"), ("v6", "6.0.0")]
    figures = by_key(doc)
    hit = {r["target"]: r for r in figures["set_tensor_hash_hit"]["results"]}
    assert hit["reference"]["median"] > 0
    assert hit["v6"]["median"] is None and "no cache" in hit["v6"]["not_applicable"]
    for key in SERVER_KEYS:
        if key == "set_tensor_hash_hit":
            continue
        ref, v6 = figures[key]["results"]
        assert ref["error"] is None and v6["error"] is None, (key, v6)
        assert len(v6["samples"]) == 2
        expected = v6["median"] / ref["median"] if figures[key]["better"] == "higher" else ref["median"] / v6["median"]
        assert v6["ratio"] == pytest.approx(expected)
    assert figures["graph_compute_1000"]["better"] == "lower"
    bulk = {(c["figure"], c["target"]): c for c in doc["bulk_comparisons"]}
    assert set(bulk) == {("set_tensor_16MiB", "v6"), ("get_tensor_16MiB", "v6")}
    ref, v6 = figures["set_tensor_16MiB"]["results"]
    assert bulk["set_tensor_16MiB", "v6"]["reference_vs_target"] == pytest.approx(ref["median"] / v6["median"])


def test_a_server_computing_wrongly_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_server("7", executor=lambda nodes: None) as lazy:  # answers, but never computes
        code, doc = run_bench(["--quick", "--repeat", "1", "--no-kit", "--no-reference", "--server",
                               f"{lazy.host}:{lazy.port}"], tmp_path, capsys)
    assert code == 1
    figures = by_key(doc)
    (graph,) = figures["graph_compute_1000"]["results"]
    assert "wrong graph result" in graph["error"] and graph["median"] is None
    (bulk,) = figures["set_tensor_1MiB"]["results"]
    assert bulk["error"] is None and bulk["median"] > 0
    assert doc["kit_figures"] == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--server", "nowhere"], "expected HOST:PORT"),
    (["--no-reference"], "needs at least one --server"),
    (["--server", "127.0.0.1:1", "--server", "x=127.0.0.1:1"], "same address twice"),
    (["--server", "reference=127.0.0.1:5"], "own name"),
    (["--repeat", "0"], "at least 1"),
    (["--proto", "5"], ""),
    (["--capture", "/nonexistent.pcap"], "no such file"),
])
def test_user_mistakes_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ggml-rpc bench: error:") and message in err and "Traceback" not in err


def test_unreachable_server_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    port = _closed_port()
    assert main(["bench", "--quick", "--no-reference", "--server", f"127.0.0.1:{port}"]) == 2
    assert "cannot talk to the server" in capsys.readouterr().err


# ---- the runner ----------------------------------------------------------------------------------------------------


class _Recorder(Measurement[str]):
    figure = Figure("t", "test figure", "ms", higher_is_better=False)

    def __init__(self, values: dict[str, list[float]]) -> None:
        self.values = values
        self.calls: list[str] = []
        self.finished: list[str] = []

    def prepare(self, target: str) -> str:
        if target == "none":
            raise NotApplicable("nothing to measure")
        return target

    def sample(self, state: str) -> float:
        self.calls.append(state)
        if state == "broken" and len(self.calls) > 3:
            raise ConnectionResetError("peer reset")
        return self.values[state].pop(0)

    def finish(self, state: str) -> None:
        self.finished.append(state)


def test_samples_interleave_and_statistics_orient_ratios() -> None:
    m = _Recorder({"a": [9, 4, 2, 4], "b": [9, 2, 1, 2], "broken": [1, 1, 1, 1], "none": []})
    fr = run_measurement(m, ["a", "b", "broken", "none"], ["A", "B", "C", "D"], repeat=3)
    # warm-up per target, then rounds A B C, A B C... (C fails in the first round, so only A B after it)
    assert m.calls == ["a", "b", "broken", "a", "b", "broken", "a", "b", "a", "b"]
    assert sorted(m.finished) == ["a", "b", "broken"]
    a, b, c, d = fr.results
    assert a.samples == [4, 2, 4] and b.samples == [2, 1, 2]
    assert a.stats.median == 4 and b.stats.median == 2
    assert a.ratio == 1.0 and b.ratio == 2.0  # milliseconds: half the time is twice as fast
    assert c.error == "peer reset" and c.stats is None and c.ratio is None
    assert d.not_applicable == "nothing to measure" and d.samples == []


def test_stats_spread_is_the_median_absolute_deviation() -> None:
    s = SampleStats.of([10, 11, 9, 10, 30])
    assert (s.median, s.minimum, s.maximum) == (10, 9, 30)
    assert s.spread_pct == pytest.approx(10.0)


# ---- what is sent ---------------------------------------------------------------------------------------------------


def test_chain_graph_is_a_valid_graph_compute() -> None:
    nodes, tensors = chain_graph(10, handle=7, base=0x10000, width=16)
    wire = encode_request(V7, Command.GRAPH_COMPUTE, {"device": 0, "n_nodes": len(nodes), "nodes": nodes,
                                                       "n_tensors": len(tensors), "tensors": tensors})
    (req,) = RequestDecoder(V7, expect_hello=False).feed(wire)
    got = req.fields["tensors"]
    ids = [CHAIN_ID_BASE + k * CHAIN_ID_STRIDE for k in range(10)]  # pointer-like, as a real client's
    assert list(got["id"]) == ids and list(req.fields["nodes"]) == ids[2:]
    assert list(got["src"][2:, 0]) == [ids[0], *ids[2:9]]  # x, then each previous node
    assert set(got["src"][2:, 1]) == {ids[1]}  # c
    assert int(got["data"][-1]) == 0x10000 + 9 * 64 and set(got["buffer"]) == {7}


def test_graph_figure_checks_the_result_on_the_reference_server() -> None:
    m = GraphCompute(50)
    with running_server("7") as srv:
        state = m.prepare(BenchTarget("ref", srv.host, srv.port))
        try:
            assert m.sample(state) > 0
            assert np.frombuffer(state.extra["out"], dtype=np.float32)[0] == 49.0  # 1 + 48 ADDs
        finally:
            m.finish(state)


@pytest.mark.parametrize("protocol", [V6, V7])
def test_kit_session_decodes_to_what_it_says(protocol, tmp_path: Path) -> None:
    from ggml_rpc.conformance.sessions.decode import decode_file
    from ggml_rpc.conformance.sessions.pcapwrite import write_session

    s = make_session(protocol, 8 << 16, chunk=1 << 16)
    write_session(tmp_path / "s.pcap", s.connections)
    (dc,) = decode_file(tmp_path / "s.pcap")
    assert dc.error is None and dc.protocol is protocol
    counts = {}
    for r in dc.requests:
        counts[r.command] = counts.get(r.command, 0) + 1
    assert counts[Command.SET_TENSOR] == counts[Command.GET_TENSOR] == 4
    sent = sum(r.data.nbytes for r in dc.requests if r.command is Command.SET_TENSOR)
    read = sum(r.size for r in dc.replies if r.command is Command.GET_TENSOR)
    assert sent + read == s.data_bytes == 8 << 16


@pytest.mark.parametrize(("path", "version"), captures({"v8-upstream-tiny-f32-big-cold.pcap": "8"},
                                                      {"v7-v7-gen-cold.pcap": "7"}))
def test_replaying_a_cache_using_capture_twice_on_one_server(path: Path, version: str, tmp_path: Path) -> None:
    from ggml_rpc.bench.kit import Replay
    from ggml_rpc.conformance.sessions.replay import load_captures

    # The first replay fills the server's cache (recorded miss); the second must expect the hit it now gets.
    m = Replay(load_captures([path]), "real")
    with running_server(version, cache_dir=str(tmp_path)) as srv:
        (fr,) = [run_measurement(m, [BenchTarget("ref", srv.host, srv.port)], ["ref"], repeat=1)]
    (r,) = fr.results
    assert r.error is None and len(r.samples) == 1 and r.samples[0] > 0
    assert len(list(tmp_path.iterdir())) == 1  # output.weight, saved once


def test_server_that_closes_at_once_is_a_usage_error(capsys):
    """A peer that accepts and closes without a HELLO reply: one line, exit 2, no traceback."""
    import socket
    import threading

    from ggml_rpc.conformance.cli import main

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_each(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            conn.close()

    t = threading.Thread(target=close_each, args=(1,), daemon=True)
    t.start()
    try:
        code = main(["bench", "--quick", "--no-reference", "--no-kit", "--server", f"127.0.0.1:{port}"])
    finally:
        listener.close()
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot talk to the server" in err and "Traceback" not in err
