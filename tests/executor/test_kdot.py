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


@pytest.mark.parametrize("type_id", kdot.K_TYPES)
def test_products_are_close_to_the_dequantised_product(type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    w = rng.standard_normal((7, 512)).astype(F)
    blocks = quantize(type_id, w).reshape(7, 2, TYPES[type_id].size)
    x = rng.standard_normal((3, 512)).astype(F)
    got = kdot.products(type_id, kdot.pack_weights(type_id, blocks), x)
    act = dequantize(Q8_K, quantize(Q8_K, x))
    want = act.astype(np.float64) @ dequantize(type_id, blocks).reshape(7, 512).T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", kdot.K_TYPES)
def test_products_are_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    assert lib.vec_dot_type(type_id) == Q8_K
    for k in (256, 512, 4096):
        w = (rng.standard_normal((16, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
        blocks = lib.from_float(type_id, w).reshape(16, k // 256, TYPES[type_id].size)
        x = (rng.standard_normal((2, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        got = kdot.products(type_id, kdot.pack_weights(type_id, blocks), x)
        for r in range(2):
            act = lib.from_float(Q8_K, x[r])
            want = np.array([lib.vec_dot(type_id, blocks[i], act) for i in range(16)], dtype=F)
            assert got[r].tobytes() == want.tobytes(), (TYPES[type_id].name, k, r, np.abs(got[r] - want).max())
