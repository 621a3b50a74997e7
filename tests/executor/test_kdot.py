"""MUL_MAT of the K-quants in upstream's own arithmetic: bit for bit against ggml's
``ggml_vec_dot_q*_K_q8_K`` called in the installed build (one token and a batch run the same kernel)."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import kdot
from ggml_rpc.reference.executor.types import Q8_K, dequantize, quantize
from ggml_rpc.spec import TYPES

F = np.float32


@pytest.fixture(scope="module")
def lib(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


def _random_blocks(type_id: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes with a sane scale: every byte pattern of a grid type's indices, signs and sub-block
    scales is a valid block (its quantiser needs an importance matrix, so real ones are not made here)."""
    size = TYPES[type_id].size
    blocks = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    d = rng.uniform(0.001, 1.0, (rows, k // 256)).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, k // 256, 2)  # d leads every grid block
    return blocks


def _blocks(lib: GgmlLibrary | None, type_id: int, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    rows, k = w.shape
    if type_id in kdot.GRID_FACTORS:
        return _random_blocks(type_id, rows, k, rng)
    raw = lib.from_float(type_id, w) if lib is not None else quantize(type_id, w)
    return np.asarray(raw, dtype=np.uint8).reshape(rows, k // 256, TYPES[type_id].size)


PLAIN = tuple(t for t in kdot.K_TYPES if t not in kdot.GRID_FACTORS)
GRID = tuple(kdot.GRID_FACTORS)


@pytest.fixture
def codebooks(upstream_peer):
    """The IQ codebooks read from the installed build, as ``ggml-rpc serve`` configures its executor."""
    from ggml_rpc.conformance.upstream import codebooks as cb
    from ggml_rpc.reference.executor import grids

    previous = grids._source
    grids.use_codebooks(cb.tables)
    yield
    grids.use_codebooks(previous)


def _close(type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    w = rng.standard_normal((7, 512)).astype(F)
    blocks = _blocks(None, type_id, w, rng)
    x = rng.standard_normal((3, 512)).astype(F)
    got = kdot.products(type_id, kdot.pack_weights(type_id, blocks), x, len(blocks))
    act = dequantize(Q8_K, quantize(Q8_K, x))
    want = act.astype(np.float64) @ dequantize(type_id, blocks).reshape(7, 512).T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("type_id", PLAIN)
def test_products_are_close_to_the_dequantised_product(type_id: int) -> None:
    _close(type_id)


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", GRID)
def test_grid_products_are_close_to_the_dequantised_product(codebooks, type_id: int) -> None:
    _close(type_id)


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", PLAIN)
def test_products_are_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, type_id: int) -> None:
    _bit_for_bit(lib, type_id)


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", GRID)
def test_grid_products_are_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, codebooks, type_id: int) -> None:
    _bit_for_bit(lib, type_id)


def _bit_for_bit(lib: GgmlLibrary, type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    assert lib.vec_dot_type(type_id) == Q8_K
    for k in (256, 512, 4096):
        w = (rng.standard_normal((16, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
        blocks = _blocks(lib, type_id, w, rng)
        x = (rng.standard_normal((2, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        got = kdot.products(type_id, kdot.pack_weights(type_id, blocks), x, len(blocks))
        for r in range(2):
            act = lib.from_float(Q8_K, x[r])
            want = np.array([lib.vec_dot(type_id, blocks[i], act) for i in range(16)], dtype=F)
            assert got[r].tobytes() == want.tobytes(), (TYPES[type_id].name, k, r, np.abs(got[r] - want).max())
