"""MUL_MAT of a few rows with the weights on the left, in blocks of rows: the same products as one plain matmul."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import matmul
from ggml_rpc.reference.executor.matmul import weights_left


@pytest.mark.parametrize(("m", "k", "n"), [(2048, 2048, 5), (1000, 2048, 3), (97, 64, 2), (5632, 2048, 16),
                                           (256, 256, 64), (33, 4096, 7)])
def test_blocks_give_the_plain_product(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 31 + n)
    a = rng.standard_normal((1, 1, m, k), dtype=np.float32)
    b = rng.standard_normal((1, 1, n, k), dtype=np.float32)
    got = weights_left(a, b)
    assert got.shape == (1, 1, m, n) and got.dtype == np.float32
    want = a[0, 0].astype(np.float64) @ b[0, 0].astype(np.float64).T
    # float32 products of length k: each within a few ulps of the float64 value times the row's magnitude
    scale = np.abs(a[0, 0]).astype(np.float64) @ np.abs(b[0, 0]).astype(np.float64).T
    assert np.all(np.abs(got[0, 0] - want) <= 1e-5 * scale)


def test_blocks_are_taken_for_a_short_batch_and_cover_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = np.matmul

    def spy(x, y, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((x.shape[-2], y.shape[-1]))
        return real(x, y, *args, **kwargs)

    monkeypatch.setattr(matmul.np, "matmul", spy)
    m, k, n = 1000, 2048, 5
    a = np.ones((1, 1, m, k), dtype=np.float32)
    b = np.ones((1, 1, n, k), dtype=np.float32)
    out = weights_left(a, b)
    assert len(calls) > 1 and sum(rows for rows, _ in calls) == m  # several blocks, every row once
    assert all(cols == n for _, cols in calls)
    assert np.all(out == k)


def test_batched_weights_are_not_blocked() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 3, 40, 32), dtype=np.float32)
    b = rng.standard_normal((2, 3, 4, 32), dtype=np.float32)
    np.testing.assert_allclose(weights_left(a, b), a @ b.swapaxes(-1, -2), rtol=1e-5, atol=1e-5)


def test_one_row_through_a_large_matrix_of_short_rows_is_streamed() -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, 1, 32000, 256), dtype=np.float32)  # 32 MB: a small model's output layer
    b = rng.standard_normal((1, 1, 1, 256), dtype=np.float32)
    out = np.full((1, 1, 1, 32000), np.nan, dtype=np.float32)
    assert matmul.streams_short_rows(a, b, out)
    np.testing.assert_allclose(out, b @ a.swapaxes(-1, -2), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", ["long rows", "small matrix", "two rows", "strided out"])
def test_other_products_are_left_to_blas(case: str) -> None:
    shape, n = {"long rows": ((1, 1, 8192, 1024), 1), "small matrix": ((1, 1, 256, 256), 1),
                "two rows": ((1, 1, 32000, 256), 2), "strided out": ((1, 1, 32000, 256), 1)}[case]
    a = np.zeros(shape, dtype=np.float32)
    b = np.zeros((1, 1, n, shape[-1]), dtype=np.float32)
    out = np.zeros((1, 1, n, shape[-2]), dtype=np.float32)
    if case == "strided out":  # every other value of a wider row: einsum would write a reshaped copy
        out = np.zeros((1, 1, 1, 2 * shape[-2]), dtype=np.float32)[..., ::2]
    assert not matmul.streams_short_rows(a, b, out)


@pytest.mark.parametrize(("weight_type", "m", "k"), [(0, 48, 64), (1, 48, 64), (8, 48, 64), (0, 32000, 256),
                                                     (8, 40, 96)])
def test_a_prepared_one_token_product_is_the_kernels(weight_type: int, m: int, k: int) -> None:
    from ggml_rpc.reference.executor.arena import Arena
    from ggml_rpc.reference.executor.core import KERNELS
    from ggml_rpc.reference.executor.memory import Memory
    from ggml_rpc.reference.executor.plan import prepare
    from ggml_rpc.spec import GgmlOp

    rng = np.random.default_rng(m + k + weight_type)
    weights, compute = Arena(m * k * 4 + 4096), Arena(1 << 20)
    w = weights.tensor(weight_type, (k, m), name="w")
    weights.set(w, rng.standard_normal((m, k)).astype(np.float32))
    x = compute.tensor(0, (k, 1), name="x")
    compute.set(x, rng.standard_normal((1, k)).astype(np.float32))
    out = compute.tensor(0, (m, 1), op=GgmlOp.MUL_MAT, src=(w, x), name="out")
    plan = prepare([out])
    assert plan.kinds == ["prepared"]
    plan.run({id(weights.memory): 0, id(compute.memory): 0})
    plan.run({id(weights.memory): 0, id(compute.memory): 0})  # the second run serves a kept conversion
    got = compute.get(out).copy()
    KERNELS[int(GgmlOp.MUL_MAT)](out, Memory())
    assert got.tobytes() == compute.get(out).tobytes()


def test_products_the_fast_step_does_not_cover_go_to_the_kernel() -> None:
    from ggml_rpc.reference.executor.arena import Arena
    from ggml_rpc.reference.executor.plan import prepare
    from ggml_rpc.spec import GgmlOp

    ar = Arena(1 << 20)
    w = ar.tensor(0, (64, 16), name="w")
    two = ar.tensor(0, (64, 2), name="two rows")
    f16_row = ar.tensor(1, (64, 1), name="an F16 row")
    bad = ar.tensor(0, (32, 1), name="too short")
    nodes = [ar.tensor(0, (16, 2), op=GgmlOp.MUL_MAT, src=(w, two)),
             ar.tensor(0, (16, 1), op=GgmlOp.MUL_MAT, src=(w, f16_row)),
             ar.tensor(0, (16, 1), op=GgmlOp.MUL_MAT, src=(w, bad))]
    assert prepare(nodes).kinds == ["kernel", "kernel", "kernel"]
