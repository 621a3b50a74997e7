"""More per-op tests against independent numpy formulations: SET_ROWS with broadcast indices and F16 sources,
copies between quantised tensors of different shapes, and (further down) the ops added for test-backend-ops."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType, GluOp

from .test_ops import filled, permuted, rand

F32, F16 = int(GgmlType.F32), int(GgmlType.F16)
I32, I64 = int(GgmlType.I32), int(GgmlType.I64)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 21)


def set_rows_node(arena: Arena, dst, src, idx):
    out = arena.view_of(dst, tuple(dst.ne), dst.nb, op=GgmlOp.SET_ROWS)
    out.src = [src, idx, dst, *([None] * 7)]
    out.flags = 16
    return out


@pytest.mark.parametrize("idx_type", [I32, I64])
@pytest.mark.parametrize(("dst_type", "src_type"), [(F32, F32), (F16, F32), (F32, F16), (int(GgmlType.Q4_K), F32),
                                                    (int(GgmlType.Q1_0), F16)])
def test_set_rows_broadcasts_indices_over_dims_2_and_3(arena, idx_type, dst_type, src_type):
    ne0 = 256 if dst_type not in (F32, F16) else 3
    dst_vals = rand(4, 2, 6, ne0)  # dst [ne0, 6, 2, 4]
    src_vals = rand(4, 2, 3, ne0, seed=1)  # three rows per (i2, i3)
    rows = np.array([[[5, 0, 2]], [[1, 4, 3]]])  # idx [3, 1, 2]: shared over dim 2, alternating over dim 3
    dst = filled(arena, dst_type, (ne0, 6, 2, 4), dst_vals)
    src = filled(arena, src_type, (ne0, 3, 2, 4), src_vals)
    idx = arena.tensor(idx_type, (3, 1, 2))
    arena.set_raw(idx, rows.astype(np.int32 if idx_type == I32 else np.int64))
    before = arena.get(dst).copy()
    execute([set_rows_node(arena, dst, src, idx)])
    src_read = src_vals.astype(np.float16).astype(np.float32) if src_type == F16 else src_vals
    want = before.copy()
    for i3 in range(4):
        for i2 in range(2):
            for i1 in range(3):
                want[i3, i2, rows[i3 % 2, i2 % 1, i1]] = ty.through_type(dst_type, src_read[i3, i2, i1][None])[0]
    np.testing.assert_array_equal(arena.get(dst), want)


def test_set_rows_from_a_permuted_source(arena):
    src_vals = rand(1, 1, 4, 2)  # src [2, 4]: rows of two values, stored transposed
    src = permuted(arena, src_vals)
    dst = filled(arena, F32, (2, 5), np.zeros((1, 1, 5, 2), np.float32))
    idx = arena.tensor(I64, (4,))
    arena.set_raw(idx, np.array([4, 0, 3, 1], np.int64))
    execute([set_rows_node(arena, dst, src, idx)])
    want = np.zeros((5, 2), np.float32)
    want[[4, 0, 3, 1]] = src_vals[0, 0]
    np.testing.assert_array_equal(arena.get(dst)[0, 0], want)


def test_same_type_quantised_copy_walks_a_permuted_source_block_by_block(arena):
    q = int(GgmlType.Q2_K)
    vals = rand(1, 3, 2, 256)
    base = filled(arena, q, (256, 2, 3), vals)
    nb = base.nb
    perm = arena.view_of(base, (256, 3, 2), (nb[0], nb[2], nb[1], nb[3]), op=GgmlOp.PERMUTE)
    out = arena.tensor(q, (256, 3, 2), op=GgmlOp.CPY, src=(perm,))
    execute([out])
    np.testing.assert_array_equal(arena.raw(out)[0], arena.raw(base)[0].transpose(1, 0, 2, 3))


@pytest.mark.parametrize("swapped", [0, 1])
def test_fused_glu_of_an_odd_width_takes_the_floor_and_drops_the_last_column(arena, swapped):
    x = rand(1, 2, 3, 9)  # width 9 -> halves of 4, column 8 unused
    a = filled(arena, F32, (9, 3, 2), x)
    out = arena.tensor(F32, (4, 3, 2), op=GgmlOp.GLU, src=(a,), params=params(int(GluOp.REGLU), swapped))
    execute([out])
    gate, lin = (x[..., 4:8], x[..., 0:4]) if swapped else (x[..., 0:4], x[..., 4:8])
    np.testing.assert_array_equal(arena.get(out), np.maximum(gate, 0) * lin)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_of_quantised_sources_joins_whole_blocks(arena, dim):
    q = int(GgmlType.Q4_0)
    ne_a = [64, 2, 3, 2]
    ne_b = list(ne_a)
    ne_b[dim] = 32 if dim == 0 else 1
    a = filled(arena, q, tuple(ne_a), rand(*ne_a[::-1]))
    b = filled(arena, q, tuple(ne_b), rand(*ne_b[::-1], seed=1))
    ne_o = list(ne_a)
    ne_o[dim] += ne_b[dim]
    out = arena.tensor(q, tuple(ne_o), op=GgmlOp.CONCAT, src=(a, b), params=params(dim))
    execute([out])
    # Values, not just bytes: the joined tensor reads back as the two sources' values side by side.
    np.testing.assert_array_equal(arena.get(out), np.concatenate((arena.get(a), arena.get(b)), axis=3 - dim))
