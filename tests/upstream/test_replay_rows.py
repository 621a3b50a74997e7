"""The REPLAY rows' verdicts: a replay that compared no computed result, or whose worst read is over the bar,
never passes a zoo row (the replay itself is stubbed: these are the row's own decisions)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from ggml_rpc.conformance.sessions.compare import ReplayReport
from ggml_rpc.conformance.upstream import matrix
from ggml_rpc.conformance.upstream.cells import FAIL, PASS


def _row(monkeypatch, tmp_path: Path, report: ReplayReport, model: str = "zoo-q4_0") -> matrix.Cell:
    @contextlib.contextmanager
    def server(_major, _cache):
        yield "127.0.0.1:1"

    monkeypatch.setattr(matrix, "reference_server", server)
    monkeypatch.setattr(matrix, "replay", lambda *_a, **_k: report)
    peer = SimpleNamespace(version="7.0.0", label="7.0.0", major=7)
    ws = SimpleNamespace(recorded={("7.0.0", model): tmp_path / "s.pcap"}, root=tmp_path, zoo=[model])
    return matrix.replay_row(peer, ws, model, "reference")


def _report(computed: int, worst: float, by_op: dict) -> ReplayReport:
    r = ReplayReport(target="127.0.0.1:1", source_versions=["7.0.0"], target_version="7.0.0")
    r.requests, r.worst_nmse, r.nmse_by_op = 100, worst, by_op
    r.compared["computed"] = computed
    return r


def test_nothing_computed_is_never_a_pass(monkeypatch, tmp_path):
    cell = _row(monkeypatch, tmp_path, _report(0, 0.0, {}))
    assert cell.status == FAIL and "no computed result" in cell.detail


@pytest.mark.parametrize(("worst", "by_op", "status"), [
    (0.0, {"MUL_MAT": {"reads": 3, "worst_nmse": 0.0, "by_src0_type": {}}}, PASS),
    (1e-6, {"MUL_MAT": {"reads": 3, "worst_nmse": 1e-6, "by_src0_type": {"Q4_0": {"reads": 3, "worst_nmse": 1e-6}}}},
     FAIL),
    # The worst read was not attributed to an op: over the bar all the same.
    (1e-6, {"MUL_MAT": {"reads": 3, "worst_nmse": 1e-12, "by_src0_type": {}}}, FAIL),
])
def test_a_zoo_row_asks_the_bar_of_every_read(monkeypatch, tmp_path, worst, by_op, status):
    cell = _row(monkeypatch, tmp_path, _report(3, worst, by_op))
    assert cell.status == status, cell.detail
