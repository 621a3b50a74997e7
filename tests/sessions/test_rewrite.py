"""Graph uids across versions (``replay --as``): added for 8.0.0, dropped for 7.0 with older uids recomputed as
their recorded graph."""

from __future__ import annotations

from ggml_rpc.conformance.sessions.rewrite import GraphRewrite
from ggml_rpc.spec import V7, V8, Command

C, R = Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE


def test_uids_are_added_for_8() -> None:
    g = GraphRewrite(V7, V8)
    assert g.request(C, {"device": 0, "nodes": [1]}) == (C, {"device": 0, "nodes": [1], "uid": 1})
    assert g.request(C, {"device": 0, "nodes": [2]})[1]["uid"] == 2
    assert g.request(R, {"device": 0}) == (R, {"device": 0, "uid": 2})  # a 7.0 server re-runs the last graph


def test_uids_are_dropped_for_7_and_an_older_graph_is_computed_again() -> None:
    g = GraphRewrite(V8, V7)
    first = {"device": 0, "uid": 21, "nodes": [1]}
    assert g.request(C, first) == (C, {"device": 0, "nodes": [1]})
    assert g.request(C, {"device": 0, "uid": 24, "nodes": [2]}) == (C, {"device": 0, "nodes": [2]})
    assert g.request(R, {"device": 0, "uid": 24}) == (R, {"device": 0})  # the device's last graph
    assert g.request(R, {"device": 0, "uid": 21}) == (C, {"device": 0, "nodes": [1]})  # an older one: computed
    assert g.request(R, {"device": 0, "uid": 21}) == (R, {"device": 0})  # now the last
    assert g.request(R, {"device": 0, "uid": 99}) == (R, {"device": 0})  # unknown: the server closes, as recorded


def test_same_version_is_left_alone() -> None:
    g = GraphRewrite(V8, V8)
    fields = {"device": 0, "uid": 3, "nodes": [1]}
    assert g.request(R, fields) == (R, fields) and not g.active
