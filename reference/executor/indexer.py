"""LIGHTNING_INDEXER: DeepSeek sparse attention's lightning indexer scores.

For each query token t and key position s: ``sum_h w[h, t] * relu(q[:, h, t] . k[:, s]) + mask[s, t]``, with
the per-head weights already scaled by the caller (ggml.h: "prescaled") and the F16 mask broadcast over dim 3.

In the arithmetic of upstream's CPU backend: each key row converted to float32 (its type's own conversion), each
head's dot with ``ggml_vec_dot_f32``'s order (q stays float32), the heads summed in order by fused multiply-adds
(its build fuses ``score += relu * w``), the mask added last.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from . import fdot
from .core import FLOATS, READABLE, kernel, need_types, read, src, write
from .memory import F32, Memory, node_error
from .simd_sums import fma32


@kernel(GgmlOp.LIGHTNING_INDEXER, src=FLOATS, dst=(F32,), note="q, k (any readable type), scaled weights, F16 mask")
def _lightning_indexer(node: GraphTensor, mem: Memory) -> None:
    q_t, k_t, w_t = src(node, 0), src(node, 1), src(node, 2)
    m_t = node.src[3] if len(node.src) > 3 else None
    need_types(node, q_t, FLOATS, "q")
    need_types(node, k_t, READABLE, "k")
    need_types(node, w_t, FLOATS, "weights")
    d, n_head, n_batch, ne3 = (int(v) for v in q_t.ne)
    n_kv = int(k_t.ne[2])
    if (k_t.ne[0] != d or k_t.ne[1] != 1 or k_t.ne[3] != ne3 or tuple(w_t.ne) != (n_head, n_batch, 1, ne3)
            or tuple(node.ne) != (n_kv, n_batch, 1, ne3)):
        raise node_error(node, "shapes do not fit the lightning indexer (q [d, h, t, b], k [d, 1, kv, b], "
                               "weights [h, t, 1, b], result [kv, t, 1, b])")
    q = read(mem, q_t)  # (b, t, h, d)
    k = read(mem, k_t)[:, :, 0]  # (b, kv, d)
    w = read(mem, w_t)[:, 0]  # (b, t, h)
    scores = np.zeros((ne3, n_batch, n_kv), dtype=np.float32)
    for b in range(ne3):
        dots = fdot.vec_dot(k[b], q[b].reshape(n_batch * n_head, d), "f32").reshape(n_batch, n_head, n_kv)
        relu = np.maximum(dots, np.float32(0))
        for h in range(n_head):
            scores[b] = fma32(relu[:, h], w[b, :, h, None], scores[b])
    if m_t is not None:
        if m_t.ne[0] != n_kv or m_t.ne[1] < n_batch or m_t.ne[3] == 0 or ne3 % int(m_t.ne[3]):
            raise node_error(node, "mask must be [kv, >= t, 1, divisor of b]")
        mask = read(mem, m_t)[:, 0, :n_batch]  # (b33, t, kv)
        scores = scores + np.tile(mask, (ne3 // int(m_t.ne[3]), 1, 1))  # i3 reads mask i3 % ne33, as ggml's masks
    write(mem, node, scores[:, None])
