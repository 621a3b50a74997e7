"""Per-op closeness of a replay: reads attributed to the graph node that computed them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from ggml_rpc.conformance.sessions.op_closeness import GraphOps, merge_by_op, ops_by_address
from ggml_rpc.spec import GgmlOp, GluOp, UnaryOp

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
_DTYPE = np.dtype([("id", "<u8"), ("type", "<u4"), ("op", "<u4"), ("op_params", "<i4", (16,)), ("src", "<u8", (10,)),
                   ("data", "<u8")])


def _tensors(rows: list[tuple[int, int, int, int]], src0: dict[int, int] | None = None,
             types: dict[int, int] | None = None) -> np.ndarray:
    """(id, op, first op param, data address) per tensor; ``src0``: id -> its source 0's id; ``types``: id -> type."""
    out = np.zeros(len(rows), dtype=_DTYPE)
    for i, (tid, op, sub, data) in enumerate(rows):
        out[i]["id"], out[i]["op"], out[i]["data"] = tid, op, data
        out[i]["op_params"][0] = sub
        out[i]["src"][0] = (src0 or {}).get(tid, 0)
        out[i]["type"] = (types or {}).get(tid, 0)
    return out


def test_nodes_are_named_by_op_and_sub_op_and_leaves_are_not_ops() -> None:
    t = _tensors([(900, 0, 0, 0x1000), (7, int(GgmlOp.MUL_MAT), 0, 0x2000),
                  (5, int(GgmlOp.UNARY), int(UnaryOp.SILU), 0x3000), (3, int(GgmlOp.GLU), int(GluOp.SWIGLU), 0x4000),
                  (4, int(GgmlOp.UNARY), 999, 0x5000)], src0={7: 900, 5: 7, 3: 77}, types={900: 12})
    at = ops_by_address(t, np.array([900, 7, 5, 3, 4, 12345], dtype=np.uint64))  # 12345: no such tensor
    assert at == {0x2000: ("MUL_MAT", "Q4_K"), 0x3000: ("SILU", "F32"), 0x4000: ("SWIGLU", "-"),
                  0x5000: ("UNARY_999", "-")}


def test_the_last_node_at_a_shared_address_is_the_one_read() -> None:
    t = _tensors([(1, int(GgmlOp.ADD), 0, 0x100), (2, int(GgmlOp.SCALE), 0, 0x100)])  # in place
    assert ops_by_address(t, np.array([1, 2], dtype=np.uint64)) == {0x100: ("SCALE", "-")}
    assert ops_by_address(t, np.array([2, 1], dtype=np.uint64)) == {0x100: ("ADD", "-")}


def test_a_recompute_keeps_the_stored_graphs_ops() -> None:
    g = GraphOps()
    g.graph({"tensors": _tensors([(1, int(GgmlOp.ADD), 0, 0x100)]), "nodes": np.array([1], dtype=np.uint64)})
    g.graph({"device": 0})  # GRAPH_RECOMPUTE: no tensors
    assert g.read_op({"tensor": {"data": 0x80}, "offset": 0x80}) == ("ADD", "-")
    assert g.read_op({"tensor": {"data": 0x100}, "offset": 4}) is None  # not where a result starts
    assert g.read_op({"device": 0}) is None


def test_reports_merge_counting_reads_and_keeping_the_worst() -> None:
    into = {"ADD": {"reads": 2, "worst_nmse": 1e-12, "by_src0_type": {"f32": {"reads": 2, "worst_nmse": 1e-12}}}}
    merge_by_op(into, {"ADD": {"reads": 3, "worst_nmse": 1e-14, "by_src0_type": {"f16": {"reads": 3,
                                                                                           "worst_nmse": 1e-14}}},
                       "MUL": {"reads": 1, "worst_nmse": 0.0}})
    assert into["ADD"]["reads"] == 5 and into["ADD"]["worst_nmse"] == 1e-12
    assert set(into["ADD"]["by_src0_type"]) == {"f32", "f16"}
    assert into["MUL"] == {"reads": 1, "worst_nmse": 0.0, "by_src0_type": {}}


def test_a_replay_reports_the_worst_nmse_of_each_op(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "ggml_rpc.conformance.cli", "replay",
                           str(FIXTURES / "v7-inference.pcap"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    by_op = report["nmse_by_op"]
    assert by_op, "no read was attributed to an op"
    assert sum(f["reads"] for f in by_op.values()) <= report["compared"]["computed"]
    # Reads of an address no node of the graph names count in the worst, not in an op's.
    assert max(f["worst_nmse"] for f in by_op.values()) <= report["worst_nmse"]
    assert all(name.isupper() for name in by_op)
    for fig in by_op.values():
        assert sum(sub["reads"] for sub in fig["by_src0_type"].values()) == fig["reads"]


def test_bf16_reads_are_compared_as_numbers() -> None:
    from ggml_rpc.conformance.nmse import nmse
    from ggml_rpc.conformance.sessions.compare import FLOAT_TYPES, float_values
    from ggml_rpc.spec import GgmlType

    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")  # exactly representable in BF16
    dtype = FLOAT_TYPES[int(GgmlType.BF16)]
    assert np.array_equal(float_values(bits.tobytes(), dtype), values.astype(np.float64))
    nudged = bits.copy()
    nudged[2] += 1  # one BF16 ulp: a close value, not a wrong one
    err = nmse(float_values(bits.tobytes(), dtype), float_values(nudged.tobytes(), dtype))
    assert 0 < err < 1e-4
