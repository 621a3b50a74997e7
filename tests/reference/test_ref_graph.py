"""Graph rebuilding (reference.graph.build_graph): references, duplicates, cycles, deep chains, refusals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from ggml_rpc.reference.graph import GraphError, build_graph
from ggml_rpc.spec import TENSOR_DTYPE, GgmlOp, make_tensor, tensors_array


@dataclass
class FakeBuffer:
    base: int
    size: int
    memory: np.ndarray


BASE = 0x7F00_0000_0000
BUF = FakeBuffer(BASE, 4096, np.zeros(4096, np.uint8))
BUFFERS = {0xAA: BUF}


def t(id: int, **kw) -> dict:
    kw.setdefault("ne", (4,))
    if "buffer" not in kw:
        kw["buffer"] = 0xAA
        kw.setdefault("data", BASE)
    return make_tensor(id=id, **kw)


def build(nodes, tensors):
    return build_graph(np.array(nodes, dtype=np.uint64), tensors_array(tensors), BUFFERS)


def test_references_are_resolved() -> None:
    g = build([3], [t(1, name="a"), t(2, data=BASE + 16), t(3, op=GgmlOp.ADD, src=[1, 2], data=BASE + 32,
                                                            flags=16, use_count=2, op_params=[7, -1])])
    (node,) = g.nodes
    assert node.id == 3 and node.op == GgmlOp.ADD and node.flags == 16 and node.use_count == 2
    assert node.src[0].name == "a" and node.src[1].offset == 16 and node.src[2] is None
    assert node.offset == 32 and node.nbytes == 16 and node.ne == (4, 1, 1, 1) and node.nb == (4, 16, 16, 16)
    assert list(node.op_params[:2]) == [7, -1] and node.op_params.dtype == np.int32
    assert node.buffer is not None and node.buffer.nbytes == 4096
    assert g.buffers == frozenset({0xAA}) and g.n_tensors == 3


def test_view_src_and_offsets() -> None:
    g = build([2], [t(1, ne=(16,)), t(2, op=GgmlOp.VIEW, view_src=1, view_offs=32, data=BASE + 32, src=[1])])
    node = g.nodes[0]
    assert node.view_src is g.nodes[0].src[0] and node.view_offs == 32 and node.offset == 32


def test_duplicate_ids_first_wins() -> None:
    g = build([2], [t(1, name="first"), t(1, name="second"), t(2, src=[1], op=GgmlOp.DUP)])
    assert g.nodes[0].src[0].name == "first"


def test_a_tensor_shared_by_two_nodes_is_one_object() -> None:
    g = build([2, 3], [t(1), t(2, src=[1], op=GgmlOp.SQR), t(3, src=[1, 2], op=GgmlOp.ADD)])
    assert g.nodes[0].src[0] is g.nodes[1].src[0] and g.nodes[1].src[1] is g.nodes[0]


def test_cycles_terminate() -> None:
    g = build([1], [t(1, src=[2], op=GgmlOp.ADD), t(2, src=[1], op=GgmlOp.ADD)])
    a = g.nodes[0]
    assert a.src[0].src[0] is a


def test_self_reference_terminates() -> None:
    g = build([1], [t(1, src=[1], view_src=1, op=GgmlOp.ADD)])
    assert g.nodes[0].src[0] is g.nodes[0] and g.nodes[0].view_src is g.nodes[0]


def test_deep_chain_has_no_recursion_limit() -> None:
    # Upstream recursion overflows its stack at 300,000 (SIGSEGV).
    n = 300_000
    arr = np.zeros(n, dtype=TENSOR_DTYPE)
    arr["id"] = np.arange(1, n + 1)
    arr["src"][1:, 0] = np.arange(1, n)
    arr["ne"] = 1
    arr["nb"] = 4
    g = build_graph(np.array([n], dtype=np.uint64), arr, {})
    node = g.nodes[0]
    depth = 0
    while node.src[0] is not None:
        node = node.src[0]
        depth += 1
    assert depth == n - 1 and node.id == 1 and g.n_tensors == n


def test_unreachable_tensors_are_not_validated() -> None:
    bad = t(9) | {"type": 200}
    g = build([1], [t(1), bad])
    assert g.n_tensors == 1


@pytest.mark.parametrize(
    ("nodes", "tensors", "message"),
    [
        ([0], [t(1)], "id 0"),
        ([5], [t(1)], "not among"),
        ([2], [t(1), t(2, src=[1, 77])], "0x4d"),
        ([2], [t(1), t(2, view_src=66)], "0x42"),
        ([1], [t(1, buffer=0, data=BASE)], "no buffer"),
        ([1], [t(1, buffer=0x1234, data=BASE)], "no buffer"),  # an unknown handle is a null buffer
        ([1], [t(1) | {"type": 43}], "type 43"),
        ([1], [t(1) | {"type": 5}], "removed"),
        ([1], [t(1, data=BASE - 4)], "outside"),
        ([1], [t(1, data=BASE + 4090)], "outside"),
        ([1], [t(1, ne=(0x7FFF_FFFF, 0x7FFF_FFFF, 3, 3), nb=(0xFFFF_FFFF,) * 4)], "outside"),
        ([2], [t(1), t(2, op=GgmlOp.CUSTOM, src=[1])], "CUSTOM"),
        ([2], [t(1), t(2, op=GgmlOp.MAP_CUSTOM2, src=[1, 1])], "MAP_CUSTOM2"),
    ],
)
def test_refusals(nodes, tensors, message) -> None:
    with pytest.raises(GraphError, match=message):
        build(nodes, tensors)


def test_null_buffer_with_zero_data_is_allowed() -> None:
    g = build([2], [t(1, buffer=0, data=0), t(2, src=[1], op=GgmlOp.SQR)])
    assert g.nodes[0].src[0].buffer is None and g.nodes[0].src[0].offset == 0


def test_custom_leaf_is_not_refused() -> None:
    # A tensor computed by a custom op in an earlier split arrives as a leaf still carrying its op: never executed.
    g = build([2], [t(1, op=GgmlOp.CUSTOM), t(2, src=[1], op=GgmlOp.SQR)])
    assert g.nodes[0].src[0].op == GgmlOp.CUSTOM


def test_a_graph_without_tensors_builds_empty_or_names_the_missing_node() -> None:
    none = np.zeros(0, dtype=TENSOR_DTYPE)
    g = build_graph(np.zeros(0, dtype=np.uint64), none, {})
    assert g.n_tensors == 0 and g.nodes == []
    with pytest.raises(GraphError, match="node 0 id 0x5 is not among the graph's tensors"):
        build_graph(np.array([5], dtype=np.uint64), none, {})
