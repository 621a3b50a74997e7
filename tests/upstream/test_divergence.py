"""The divergence finder: every node of a recorded graph computed in memory of its own and read back."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.divergence import NodeDiff, compare, differing, graph_nodes
from ggml_rpc.conformance.upstream.runs import reference_server
from ggml_rpc.spec import Command

SESSION = Path(__file__).resolve().parents[2] / "fixtures" / "upstream" / "v7-upstream-tiny-q8_0-cold.pcap"


def _first_compute(path: Path) -> tuple[int, int]:
    from ggml_rpc.conformance.sessions.decode import decode_file

    for dc in decode_file(path):
        for req in dc.requests:
            if req.command is Command.GRAPH_COMPUTE:
                return dc.conn.index, req.index
    raise AssertionError("no graph in the session")


def test_two_reference_servers_agree_on_every_node_of_a_genuine_graph():
    at = _first_compute(SESSION)
    results = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as cache, reference_server(7, Path(cache)) as address:
            results.append(graph_nodes(SESSION, address, *at))
    first, second = results
    assert len(first) == len(second) > 20
    names = [r.name for r in first]
    assert "result_output" in names and any(n.startswith("attn_norm") for n in names)
    logits = np.frombuffer(first[names.index("result_output")].data, np.float32)
    assert logits.size == 32000 and np.isfinite(logits).all() and np.abs(logits).max() > 0
    diffs = compare(first, second)
    assert all(d.equal_bytes for d in diffs) and differing(diffs, 0.0) == []


def _diff(position: int, nmse: float, sources: list[int]) -> NodeDiff:
    return NodeDiff(position, 100 + position, f"n{position}", "MUL", 0, [4, 1, 1, 1], [],
                    [100 + s for s in sources], nmse=nmse, equal_bytes=nmse == 0.0)


@pytest.mark.parametrize(("nodes", "first"), [
    # 0 differs and so does its consumer 1, which reaches the result 2: 0 is where the drift starts.
    ([(0, 1e-6, []), (1, 1e-6, [0]), (2, 1e-6, [1])], 0),
    # 0 differs but its only consumer agrees (a fused op's unwritten memory): the drift starts at 2.
    ([(0, 40.0, []), (1, 0.0, [0]), (2, 1e-6, [1])], 2),
    # A dead end that differs (an unused input's copy) is not the start either.
    ([(0, 1.0, []), (1, 0.0, []), (2, 1e-6, [1])], 2),
])
def test_first_divergence_is_a_difference_that_reaches_the_result(nodes, first):
    diffs = [_diff(*n) for n in nodes]
    assert differing(diffs, 1e-9)[0].position == first
