"""Graph-level behaviour of the executor: node order, skipped nodes, in-place results, refusals that name the op,
bounds checks before any memory is touched, and the generated ops table kept current.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ops_table import render_ops_table
from ggml_rpc.reference.executor import execute, supported_ops, supports_op
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.graph import ExecutorError, GraphTensor
from ggml_rpc.spec import GgmlOp, GgmlType, GluOp, UnaryOp

F32, F16, Q8_0 = int(GgmlType.F32), int(GgmlType.F16), int(GgmlType.Q8_0)
OPS_MD = Path(__file__).resolve().parents[2] / "reference" / "OPS.md"


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 16)


def test_nodes_run_in_order_and_see_earlier_results_through_views(arena):
    a = arena.tensor(F32, (4, 2))
    arena.set(a, 1.0)
    twice = arena.tensor(F32, (4, 2), op=GgmlOp.ADD, src=(a, a))
    row1 = arena.view_of(twice, (4,), twice.nb, offset=16)  # second row of the previous result
    out = arena.tensor(F32, (4,), op=GgmlOp.MUL, src=(row1, row1))
    execute([twice, row1, out])
    assert arena.get(out).ravel().tolist() == [4.0] * 4


def test_in_place_op_writes_into_its_source(arena):
    a = arena.tensor(F32, (4,))
    arena.set(a, np.arange(4, dtype=np.float32))
    inplace = arena.view_of(a, (4,), a.nb, op=GgmlOp.SCALE)
    inplace.src[0] = a
    inplace.flags = 16
    inplace.op_params[:] = params(3.0, *([0] * 15))
    execute([inplace])
    assert arena.get(a).ravel().tolist() == [0.0, 3.0, 6.0, 9.0]


def test_nodes_without_compute_flag_and_memory_ops_are_skipped(arena):
    a = arena.tensor(F32, (4,))
    arena.set(a, 2.0)
    out = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, a))
    out.flags = 0
    arena.set(out, -1.0)
    view = arena.view_of(a, (2, 2), (4, 8), op=GgmlOp.RESHAPE)
    view.flags = 16
    execute([out, view])
    assert arena.get(out).ravel().tolist() == [-1.0] * 4
    assert arena.get(a).ravel().tolist() == [2.0] * 4


@pytest.mark.parametrize("op", [GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2, GgmlOp.MAP_CUSTOM3, GgmlOp.CUSTOM])
def test_native_callback_ops_are_never_executed(arena, op):
    node = arena.tensor(F32, (4,), op=op, params=params(0x41414141, 0x42424242))
    node.flags = 0  # even when not flagged for computing
    with pytest.raises(ExecutorError, match="native function pointers"):
        execute([node])


def test_unsupported_op_error_names_op_types_and_shapes(arena):
    a = arena.tensor(F32, (16, 2), name="conv_state")
    node = arena.tensor(F32, (16, 2), op=GgmlOp.SSM_SCAN, src=(a,), name="scan")
    with pytest.raises(ExecutorError) as info:
        execute([node])
    msg = str(info.value)
    assert msg.startswith("SSM_SCAN:")
    assert "scan F32[16,2,1,1]" in msg and "conv_state F32[16,2,1,1]" in msg


def test_unsupported_type_combination_is_refused(arena):
    w = arena.tensor(F32, (32, 2))
    q = arena.tensor(Q8_0, (32, 3))
    out = arena.tensor(F32, (2, 3), op=GgmlOp.MUL_MAT, src=(w, q))
    with pytest.raises(ExecutorError, match="MUL_MAT: source 1 type Q8_0 is not supported"):
        execute([out])


def test_grid_type_without_codebooks_is_refused(arena, monkeypatch):
    from ggml_rpc.conformance.upstream.codebooks import ENV
    from ggml_rpc.reference.executor import grids

    monkeypatch.setenv(ENV, "off")
    grids.codebooks.cache_clear()
    try:
        a = arena.tensor(int(GgmlType.IQ2_XXS), (256,))
        out = arena.tensor(F32, (256,), op=GgmlOp.CPY, src=(a,))
        with pytest.raises(ExecutorError, match="CPY: source 0 type IQ2_XXS needs the IQ codebooks"):
            execute([out])
    finally:
        monkeypatch.undo()
        grids.codebooks.cache_clear()


def test_tensor_reaching_outside_its_buffer_is_refused_before_any_write(arena):
    a = arena.tensor(F32, (4,))
    arena.set(a, 1.0)
    out = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, a))
    arena.set(out, 5.0)
    wild = GraphTensor(id=99, type=F32, ne=(4, 2, 1, 1), nb=(4, 1 << 20, 1 << 21, 1 << 21), op=0,
                       op_params=np.zeros(16, np.int32), flags=0, buffer=arena.view, offset=0, name="wild")
    out.src[1] = wild
    with pytest.raises(ExecutorError, match=r"wild F32\[4,2,1,1\]: bytes \[0, 1048592\) fall outside"):
        execute([out])
    assert arena.get(out).ravel().tolist() == [5.0] * 4


def test_size_one_dimension_strides_cannot_escape(arena):
    # The security checklist's item 14 (conformance/fuzz/checklist.py): a dim of size 1 with a huge stride adds
    # nothing to the reach, and is never stepped.
    a = arena.tensor(F32, (4,))
    arena.set(a, np.arange(4, dtype=np.float32))
    odd = arena.view_of(a, (4, 1, 1, 1), (4, 1 << 30, 1 << 31, 1 << 31))
    out = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(odd, odd))
    execute([out])
    assert arena.get(out).ravel().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_tensor_without_server_memory_is_refused(arena):
    a = GraphTensor(id=5, type=F32, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), op=0, op_params=np.zeros(16, np.int32),
                    flags=0, name="host")
    out = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, a))
    with pytest.raises(ExecutorError, match=r"host F32.*has no server memory"):
        execute([out])


def test_quantised_tensor_with_partial_block_is_refused(arena):
    a = arena.tensor(Q8_0, (64,))
    bad = GraphTensor(id=7, type=Q8_0, ne=(40, 1, 1, 1), nb=(34, 68, 68, 68), op=0,
                      op_params=np.zeros(16, np.int32), flags=0, buffer=arena.view, offset=a.offset, name="q")
    out = arena.tensor(F32, (40,), op=GgmlOp.CPY, src=(bad,))
    with pytest.raises(ExecutorError, match="not a multiple of the block size"):
        execute([out])


def test_supports_op_follows_the_registrations(arena):
    a = arena.tensor(F32, (8,))
    q = arena.tensor(Q8_0, (32,))
    assert supports_op(arena.tensor(F32, (8,), op=GgmlOp.ADD, src=(a, a)))
    assert supports_op(arena.tensor(F32, (8,), op=GgmlOp.UNARY, src=(a,), params=params(int(UnaryOp.SILU))))
    assert supports_op(arena.tensor(F32, (4,), op=GgmlOp.GLU, src=(a,), params=params(int(GluOp.SWIGLU))))
    assert supports_op(arena.tensor(Q8_0, (32,), op=GgmlOp.CPY, src=(arena.tensor(F32, (32,)),)))
    assert not supports_op(arena.tensor(F32, (8,), op=GgmlOp.UNARY, src=(a,), params=params(99)))
    assert not supports_op(arena.tensor(F32, (8,), op=GgmlOp.FLASH_ATTN_BACK, src=(a,)))
    assert not supports_op(arena.tensor(F32, (8,), op=GgmlOp.CUSTOM))
    assert supports_op(arena.tensor(int(GgmlType.Q2_K), (256,), op=GgmlOp.CPY, src=(q,)))
    assert not supports_op(arena.tensor(int(GgmlType.IQ2_XXS), (256,), op=GgmlOp.CPY, src=(q,)))


def test_ops_table_covers_every_op_and_the_checked_in_copy_is_current():
    table = render_ops_table()
    rows = {r["op"] for r in supported_ops()}
    for op in GgmlOp:
        assert op.name in table
    for sub in UnaryOp:
        assert f"UNARY/{sub.name}" in rows
    for sub in GluOp:
        assert f"GLU/{sub.name}" in rows
    assert {"MUL_MAT", "FLASH_ATTN_EXT", "ROPE", "SET_ROWS", "GET_ROWS", "RMS_NORM"} <= rows
    assert OPS_MD.read_text(encoding="utf-8") == table, (
        "reference/OPS.md is stale: python -m ggml_rpc.conformance.upstream.ops_table > reference/OPS.md")


def test_overlapping_strides_cannot_claim_huge_element_counts(arena):
    a = arena.tensor(F32, (4,))
    huge = arena.view_of(a, (1 << 14, 1 << 14, 1, 1), (0, 0, 0, 0))
    out = arena.tensor(F32, (1,), op=GgmlOp.SUM, src=(huge,))
    with pytest.raises(ExecutorError, match="overlapping strides"):
        execute([out])


def test_element_dtypes_agree_with_the_spec_type_table():
    from ggml_rpc.reference.executor.memory import PLAIN_DTYPES
    from ggml_rpc.spec import TYPES

    for type_id, dtype in PLAIN_DTYPES.items():
        assert TYPES[type_id].blck == 1 and TYPES[type_id].size == dtype.itemsize


def test_cpy_between_f32_and_i32(arena):
    f = arena.tensor(F32, (4,))
    arena.set(f, np.array([1.9, -1.9, 7.0, 1e6], np.float32))
    to_int = arena.tensor(int(GgmlType.I32), (4,), op=GgmlOp.CPY, src=(f,))
    back = arena.tensor(F32, (4,), op=GgmlOp.CPY, src=(to_int,))
    execute([to_int, back])
    assert arena.raw(to_int).ravel().tolist() == [1, -1, 7, 1000000]
    assert arena.get(back).ravel().tolist() == [1.0, -1.0, 7.0, 1e6]
