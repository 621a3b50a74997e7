"""DeepSeek V4 hyper-connections (ggml.h's definitions): DSV4_HC_COMB, DSV4_HC_PRE, DSV4_HC_POST.

The residual stream is widened to ``hc`` streams. COMB turns per-token mixing logits into a doubly normalised
``hc x hc`` matrix (softmax, then Sinkhorn iterations), PRE collapses the streams into one input, POST spreads a
layer's output back over the streams. Each is a handful of numpy calls over all tokens at once.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import kernel, need_types, params_f32, params_i32, read, src, write
from .memory import F32, Memory, node_error

_MAX_ITER = 1024


@kernel(GgmlOp.DSV4_HC_COMB, src=(F32,), dst=(F32,), note="mixes [(2+hc)*hc, T], scale [3], base; params eps, n_iter")
def _hc_comb(node: GraphTensor, mem: Memory) -> None:
    mixes_t, scale_t, base_t = src(node, 0), src(node, 1), src(node, 2)
    for t, role in ((mixes_t, "mixes"), (scale_t, "scale"), (base_t, "base")):
        need_types(node, t, (F32,), role)
    hc, n_tok = int(node.ne[0]), int(node.ne[2])
    width = (2 + hc) * hc
    if (tuple(node.ne) != (hc, hc, n_tok, 1) or tuple(mixes_t.ne) != (width, n_tok, 1, 1)
            or int(scale_t.ne[0]) < 3 or int(base_t.ne[0]) < width):
        raise node_error(node, "shapes must be mixes [(2+hc)*hc, T], scale [3], base [(2+hc)*hc], result [hc, hc, T]")
    eps = np.float32(params_f32(node)[0])
    n_iter = int(params_i32(node)[1])
    # Each round is a pass over every token: a peer's n_iter must not buy unbounded work (ggml's models use 20).
    if not 1 <= n_iter <= _MAX_ITER:
        raise node_error(node, f"n_iter {n_iter} must be in [1, {_MAX_ITER}]")
    scale = read(mem, scale_t).reshape(-1)[2]
    base = read(mem, base_t).reshape(-1)[2 * hc : width].reshape(hc, hc)
    # Logit (dst, src) sits at 2*hc + dst + hc*src: as (T, src, dst), dst varies fastest, like the result.
    logits = read(mem, mixes_t).reshape(n_tok, width)[:, 2 * hc :].reshape(n_tok, hc, hc) * scale + base
    e = np.exp(logits - logits.max(axis=2, keepdims=True))
    p = e / e.sum(axis=2, keepdims=True) + eps  # softmax over dst, then eps
    p = p / (p.sum(axis=1, keepdims=True) + eps)  # normalise over src
    for _ in range(n_iter - 1):  # Sinkhorn rounds: bounded by the op's own parameter, each over all tokens
        p = p / (p.sum(axis=2, keepdims=True) + eps)
        p = p / (p.sum(axis=1, keepdims=True) + eps)
    write(mem, node, p.astype(np.float32)[None])


@kernel(GgmlOp.DSV4_HC_PRE, src=(F32,), dst=(F32,), note="x [E, hc, T] by weights [hc, T], or sigmoid-gated (param)")
def _hc_pre(node: GraphTensor, mem: Memory) -> None:
    x_t, w_t = src(node, 0), src(node, 1)
    need_types(node, x_t, (F32,), "x")
    need_types(node, w_t, (F32,), "weights")
    n_embd, hc, n_tok = (int(v) for v in x_t.ne[:3])
    gated = int(params_i32(node)[1]) != 0
    want_w = (n_embd, hc, n_tok, 1) if gated else (hc, n_tok, 1, 1)
    if x_t.ne[3] != 1 or tuple(w_t.ne) != want_w or tuple(node.ne) != (n_embd, n_tok, 1, 1):
        raise node_error(node, "shapes must be x [E, hc, T], weights [hc, T] (gate [E, hc, T]), result [E, T]")
    x = read(mem, x_t)[0]  # (T, hc, E)
    if gated:
        gate = read(mem, w_t)[0]
        scale = np.float32(params_f32(node)[0])
        out = (x / (np.float32(1) + np.exp(-gate))).sum(axis=1, dtype=np.float32) * scale
    else:
        w = read(mem, w_t)[0, 0]  # (T, hc)
        out = np.einsum("the,th->te", x, w, dtype=np.float32)
    write(mem, node, out[None, None])


@kernel(GgmlOp.DSV4_HC_POST, src=(F32,), dst=(F32,), note="x [E, T], residual [E, hc, T], post [hc, T], comb (or none)")
def _hc_post(node: GraphTensor, mem: Memory) -> None:
    x_t, r_t, p_t = src(node, 0), src(node, 1), src(node, 2)
    c_t = node.src[3] if len(node.src) > 3 else None
    for t, role in ((x_t, "x"), (r_t, "residual"), (p_t, "post")) + (((c_t, "comb"),) if c_t is not None else ()):
        need_types(node, t, (F32,), role)
    n_embd, hc, n_tok = (int(v) for v in r_t.ne[:3])
    if (r_t.ne[3] != 1 or tuple(x_t.ne) != (n_embd, n_tok, 1, 1) or tuple(p_t.ne) != (hc, n_tok, 1, 1)
            or tuple(node.ne) != (n_embd, hc, n_tok, 1)
            or (c_t is not None and tuple(c_t.ne) != (hc, hc, n_tok, 1))):
        raise node_error(node, "shapes must be x [E, T], residual [E, hc, T], post [hc, T], comb [hc, hc, T]")
    x = read(mem, x_t)[0, 0]  # (T, E)
    post = read(mem, p_t)[0, 0]  # (T, hc)
    res = read(mem, r_t)[0]  # (T, src, E)
    out = x[:, None, :] * post[:, :, None]
    if c_t is None:
        out = out + res
    else:
        comb = read(mem, c_t)[0]  # (T, src, dst)
        out = out + np.einsum("tse,tsd->tde", res, comb, dtype=np.float32)
    write(mem, node, out[None])
