"""LIGHTNING_INDEXER: DeepSeek sparse attention's lightning indexer scores.

For each query token t and key position s: ``sum_h w[h, t] * relu(q[:, h, t] . k[:, s]) + mask[s, t]``, with
the per-head weights already scaled by the caller (ggml.h: "prescaled") and the F16 mask broadcast over dim 3.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, READABLE, kernel, need_types, read, src, write
from .memory import F16, F32, Memory, node_error
from .types import through_type


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
    if k_t.type not in FLOATS:
        # Against quantised keys ggml's CPU indexer takes q as F16 (measured: with q in the keys' vec-dot
        # type instead, 91 of upstream's 210 test-backend-ops cases miss its 1e-6 error bound).
        q = through_type(F16, np.ascontiguousarray(q, dtype=np.float32))
    k = read(mem, k_t)[:, :, 0]  # (b, kv, d)
    w = read(mem, w_t)[:, 0]  # (b, t, h)
    dots = np.einsum("bthd,bsd->btsh", q, k, dtype=np.float32)  # (b, t, kv, h)
    scores = np.einsum("btsh,bth->bts", np.maximum(dots, np.float32(0)), w, dtype=np.float32)
    if m_t is not None:
        if m_t.ne[0] != n_kv or m_t.ne[1] < n_batch or m_t.ne[3] == 0 or ne3 % int(m_t.ne[3]):
            raise node_error(node, "mask must be [kv, >= t, 1, divisor of b]")
        mask = read(mem, m_t)[:, 0, :n_batch]  # (b33, t, kv)
        scores = scores + np.tile(mask, (ne3 // int(m_t.ne[3]), 1, 1))  # i3 reads mask i3 % ne33, as ggml's masks
    write(mem, node, scores[:, None])
