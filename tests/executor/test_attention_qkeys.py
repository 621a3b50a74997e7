"""FLASH_ATTN_EXT with quantised keys, pinned to upstream: every score is ggml's own vector dot of the key row with the
query quantised to the key type's vec-dot type (``ggml_vec_dot_*`` and ``from_float`` of the installed build, called
through ctypes), times the scale in float32; the rest is ggml's one-query recurrence (the loop written out in
``test_attention_online``).  Scores taken any other way (float32 BLAS on dequantised keys, say) differ in their last
bits, and the outputs with them."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.memory import Memory
from ggml_rpc.reference.executor.types import VEC_DOT_TYPE, dequantize, through_type
from ggml_rpc.spec import TYPES, GgmlOp, GgmlType

from .test_attention_online import _one_row

F = np.float32
KEY_TYPES = [int(GgmlType.Q8_0), int(GgmlType.Q4_0), int(GgmlType.Q5_1)]


@pytest.fixture(scope="module")
def lib(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


def _attention(k_type: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The reference's FLASH_ATTN_EXT of one query row (d,) over keys/values (n_kv, d), K stored as ``k_type`` and
    V as F16: (its output (d,), the key blocks (n_kv, nb, size) as stored)."""
    d, n_kv = q.shape[0], k.shape[0]
    arena = Arena(1 << 16)
    qt, kt, vt = arena.tensor(int(GgmlType.F32), (d, 1)), arena.tensor(k_type, (d, n_kv)), \
        arena.tensor(int(GgmlType.F16), (d, n_kv))
    arena.set(qt, q.reshape(1, 1, 1, d))
    arena.set(kt, k.reshape(1, 1, n_kv, d))
    arena.set(vt, v.reshape(1, 1, n_kv, d))
    node = arena.tensor(int(GgmlType.F32), (d, 1, 1), op=GgmlOp.FLASH_ATTN_EXT, src=(qt, kt, vt),
                        params=params(scale, 0.0, 0.0))
    execute([node])
    blocks = Memory().raw(kt)[0, 0].reshape(n_kv, d // TYPES[k_type].blck, TYPES[k_type].size)
    return arena.get(node).reshape(-1), blocks


@pytest.mark.upstream
@pytest.mark.parametrize("k_type", KEY_TYPES)
def test_quantised_key_scores_are_ggmls_vec_dot(lib: GgmlLibrary, k_type: int) -> None:
    rng = np.random.default_rng(k_type)
    differs = 0
    for _ in range(8):
        d, n_kv, scale = 64, 9, F(0.125)
        q, k, v = ((rng.standard_normal((n, d)) * 2).astype(F) for n in (1, n_kv, n_kv))
        got, blocks = _attention(k_type, q[0], k, v, float(scale))
        act = lib.from_float(VEC_DOT_TYPE[k_type], q)
        scores = np.array([F(F(lib.vec_dot(k_type, blocks[j], act)) * scale) for j in range(n_kv)], dtype=F)
        values = v.astype(np.float16).astype(F)
        assert got.tobytes() == _one_row(scores, values, None).tobytes()
        # The same recurrence over float32 BLAS scores (dequantised keys, queries through the vec-dot type): the
        # form the executor had before; the test must tell them apart.
        blas = (dequantize(k_type, blocks) @ through_type(VEC_DOT_TYPE[k_type], q)[0]) * scale
        differs += _one_row(blas.astype(F), values, None).tobytes() != got.tobytes()
    assert differs  # at least one of the eight cases separates upstream's dot from BLAS
