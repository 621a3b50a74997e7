"""MUL_MAT of F32 and F16 weights in upstream's arithmetic: the one-token form bit for bit against ggml's
``ggml_vec_dot_f32``/``_f16`` called in the installed build; the batch form (tinyBLAS) against a plain loop."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import fdot

F = np.float32
F32_ID, F16_ID = 0, 1


@pytest.fixture(scope="module")
def lib(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


def _tinyblas_loop(w: np.ndarray, x: np.ndarray, r: int, c: int) -> np.float32:
    k = w.shape[1]
    acc = np.zeros(8, F)
    for i in range(0, k, 8):
        a, b = np.zeros(8), np.zeros(8)
        a[: min(8, k - i)], b[: min(8, k - i)] = w[c, i : i + 8], x[r, i : i + 8]
        acc = (a * b + acc).astype(F)
    t = acc[4:] + acc[:4]  # tinyBLAS's hsum: the halves, then (0 + 2) + (1 + 3)
    return F((t[0] + t[2]) + (t[1] + t[3]))


def test_tinyblas_is_its_loop() -> None:
    """Every output one chain in tinyBLAS's order, whichever tile of the compiled loop computes it: whole 8 x 3
    and 4 x 3 tiles, their x 2 and x 1 edges, the weight rows past the last four, rows with a partial last 8, and
    rows further apart than their length (views into wider arrays)."""
    rng = np.random.default_rng(1)
    for k in (8, 13, 64, 100):
        for m, n in ((4, 3), (8, 7), (5, 2), (11, 4), (3, 1), (12, 5), (16, 8)):
            w, x = rng.standard_normal((m, k)).astype(F), rng.standard_normal((n, k)).astype(F)
            for w_in, x_in in ((w, x), (np.pad(w, ((0, 0), (0, 5)))[:, :k], np.pad(x, ((0, 0), (0, 3)))[:, :k])):
                got = fdot.tinyblas(w_in, x_in)
                want = np.array([[_tinyblas_loop(w, x, r, c) for c in range(m)] for r in range(n)], dtype=F)
                assert got.tobytes() == want.tobytes(), (k, m, n)


@pytest.mark.upstream
@pytest.mark.parametrize("half", [False, True])
def test_one_token_product_is_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, half: bool) -> None:
    rng = np.random.default_rng(int(half))
    for k in (8, 32, 48, 100, 256, 4096):
        w = (rng.standard_normal((16, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
        x = (rng.standard_normal((1, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        if half:
            w = w.astype(np.float16).astype(F)
        got = fdot.products(w, x, half=half, batch=False)[0]
        dtype = np.float16 if half else F
        xb = x[0].astype(dtype).view(np.uint8)
        want = np.array([lib.vec_dot(F16_ID if half else F32_ID, w[i].astype(dtype).view(np.uint8), xb)
                         for i in range(16)], dtype=F)
        assert got.tobytes() == want.tobytes(), (half, k, np.abs(got - want).max())


@pytest.mark.upstream
def test_bf16_product_is_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary) -> None:
    from ggml_rpc.reference.executor.formats import bf16_to_f32, f32_to_bf16

    rng = np.random.default_rng(30)
    for k in (8, 32, 48, 100, 256, 4096):
        w = bf16_to_f32(f32_to_bf16((rng.standard_normal((16, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)))
        x = (rng.standard_normal((1, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        got = fdot.products(w, x, half=False, batch=False, brain=True)[0]
        xb = f32_to_bf16(x[0]).view(np.uint8)
        want = np.array([lib.vec_dot(30, f32_to_bf16(w[i]).view(np.uint8), xb) for i in range(16)], dtype=F)
        assert got.tobytes() == want.tobytes(), (k, np.abs(got - want).max())


def test_a_batch_with_non_contiguous_src1_takes_the_vector_dot() -> None:
    # ggml tries tinyBLAS on F32 x F32 only for a contiguous src1; otherwise every pair goes through the vector dot.
    from ggml_rpc.reference.executor import execute
    from ggml_rpc.reference.executor.arena import Arena
    from ggml_rpc.spec import GgmlOp

    from .test_ops import filled, permuted

    rng = np.random.default_rng(3)
    arena = Arena(1 << 20)
    w = rng.standard_normal((8, 40)).astype(F)
    x = rng.standard_normal((1, 1, 40, 3)).astype(F)  # permuted: a [40, 3] view with its dims 0 and 1 swapped
    wt = filled(arena, F32_ID, (40, 8), w)
    xt = permuted(arena, x.transpose(0, 1, 3, 2))
    out = arena.tensor(F32_ID, (8, 3), op=GgmlOp.MUL_MAT, src=(wt, xt))
    contiguous = arena.tensor(F32_ID, (8, 3), op=GgmlOp.MUL_MAT, src=(wt, filled(arena, F32_ID, (40, 3), x[0, 0].T)))
    execute([out, contiguous])
    rows = np.ascontiguousarray(x[0, 0].T)
    assert arena.get(out).reshape(3, 8).tobytes() == fdot.vec_dot(w, rows, "f32").tobytes()
    assert arena.get(contiguous).reshape(3, 8).tobytes() == fdot.tinyblas(w, rows).tobytes()
    assert fdot.vec_dot(w, rows, "f32").tobytes() != fdot.tinyblas(w, rows).tobytes()  # the case tells them apart
