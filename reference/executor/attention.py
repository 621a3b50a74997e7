"""FLASH_ATTN_EXT: softmax(scale * Q K^T [softcapped] + slope * mask) V, per head, with K/V heads broadcast.

ggml's CPU backend (the one-query-at-a-time path) converts Q to K's vec-dot type, walks the KV positions in
order with an online softmax, and for an F16 V keeps the running weighted sum in F16 (rounded after every
step); positions whose mask is -inf are skipped.  That recurrence is reproduced here, vectorised over all query
rows and heads; for 64 or more query rows with F16/F32 K and V ggml takes its tiled path, which accumulates in
float32 without converting Q, and so does this code.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from . import fdot
from .core import READABLE, convert, kernel, need_types, params_f32, read, src, write
from .libm import expf
from .matmul import broadcast_matmul
from .memory import F16, F32, Memory, node_error
from .softmax import alibi_slopes, broadcast_mask
from .types import VEC_DOT_TYPE, through_type

_TILE_ROWS = 64
_CHUNK_SCORES = 1 << 22


@kernel(GgmlOp.FLASH_ATTN_EXT, src=READABLE, dst=(F32,), note="K/V F32, F16, BF16 or quantised; mask, softcap, sinks")
def _flash_attn_ext(node: GraphTensor, mem: Memory) -> None:
    q_t, k_t, v_t = src(node, 0), src(node, 1), src(node, 2)
    mask_t, sinks_t = node.src[3], node.src[4]
    need_types(node, q_t, (F32,), "Q")
    need_types(node, k_t, READABLE, "K")
    need_types(node, v_t, READABLE, "V")
    dk, n_q, n_head, n_seq = (int(x) for x in q_t.ne)
    dk1, n_kv, n_head_kv, k3 = (int(x) for x in k_t.ne)
    dv, n_kv1, n_head_v, v3 = (int(x) for x in v_t.ne)
    if dk != dk1 or n_kv != n_kv1 or n_head_kv != n_head_v or k3 != v3:
        raise node_error(node, "Q, K and V shapes do not fit together")
    if n_head_kv == 0 or k3 == 0 or n_head % n_head_kv or n_seq % k3:
        raise node_error(node, "Q heads/sequences must be whole multiples of K/V's")
    if tuple(node.ne) != (dv, n_head, n_q, n_seq) or node.type != F32:
        raise node_error(node, "result must be F32 [V.ne0, Q.ne2, Q.ne1, Q.ne3]")
    p = params_f32(node)
    scale, max_bias, softcap = np.float32(p[0]), float(p[1]), np.float32(p[2])
    if softcap != 0:
        scale = np.float32(scale / softcap)

    q = read(mem, q_t)  # (n_seq, n_head, n_q, dk)
    tiled = n_q >= _TILE_ROWS and k_t.type == v_t.type and k_t.type in (F32, F16)
    online = v_t.type == F16 and not tiled
    if not tiled and k_t.type != F32:
        q = through_type(VEC_DOT_TYPE.get(k_t.type, F32), np.ascontiguousarray(q))
    rh, rs = n_head // n_head_kv, n_seq // k3
    mask = None
    if mask_t is not None:
        need_types(node, mask_t, (F16, F32), "mask")
        mask = read(mem, mask_t)
        broadcast_mask(node, mask, n_q, n_head, n_seq, n_kv, 0, 0)  # shape check before any work
    k_raw, v_raw = mem.raw(k_t), mem.raw(v_t)  # positions on axis 2 (plain and block layouts alike)
    if online and mask is not None:
        # ggml's one-query path skips a KV position whose mask is -inf before touching K or V: only positions some
        # row can see are converted and scored (a decoding step sees a few of a long cache).
        seen = np.flatnonzero(~np.isneginf(mask[:, :, :n_q, :n_kv]).all(axis=(0, 1, 2)))
        if len(seen) < n_kv:
            k_raw, v_raw = k_raw[:, :, seen], v_raw[:, :, seen]
            mask = mask[..., seen]
            n_kv = len(seen)
    k = convert(k_t.type, k_raw)  # (k3, n_head_kv, n_kv, dk)
    v = convert(v_t.type, v_raw)  # (k3, n_head_kv, n_kv, dv)
    slopes = alibi_slopes(n_head, max_bias)[None, :, None, None] if max_bias > 0 else None
    sinks = None
    if sinks_t is not None:
        need_types(node, sinks_t, (F32,), "sinks")
        if sinks_t.ne[0] < n_head:
            raise node_error(node, "sinks need one value per head")
        sinks = read(mem, sinks_t).reshape(-1)[:n_head][None, :, None]
    if online and (rh > 1 or rs > 1):  # the online recurrence indexes V per head: one matrix per query head
        v = np.repeat(np.repeat(v, rh, axis=1), rs, axis=0)
    k_t_view = k.swapaxes(-1, -2)
    # One query at a time against an F16 K, ggml scores with ggml_vec_dot_f16: its order, not BLAS's.
    exact_dot = not tiled and k_t.type == F16
    out = np.empty((n_seq, n_head, n_q, dv), dtype=np.float32)
    # Query rows in chunks, so the score block stays small however long the context is.
    step = max(1, _CHUNK_SCORES // max(1, n_seq * n_head * n_kv))
    for lo in range(0, n_q, step):
        hi = min(n_q, lo + step)
        if exact_dot:
            scores = dot_f16_rows(q[:, :, lo:hi], k, rh, rs) * scale  # (n_seq, n_head, rows, n_kv)
        else:
            scores = broadcast_matmul(q[:, :, lo:hi], k_t_view, rh, rs) * scale
        if softcap != 0:
            scores = softcap * np.tanh(scores)
        if mask is not None:
            m = broadcast_mask(node, mask, n_q, n_head, n_seq, n_kv, lo, hi)
            scores = scores + (slopes * m if slopes is not None else m)
        if online:
            out[:, :, lo:hi] = _online_f16(scores, v, sinks)
        else:
            out[:, :, lo:hi] = _softmax_v(scores, v, sinks, rh, rs)
    # Result layout is [dv, head, query, seq]: swap head and query.
    write(mem, node, out.swapaxes(1, 2))


def dot_f16_rows(q: np.ndarray, k: np.ndarray, rh: int, rs: int) -> np.ndarray:
    """Every query row of ``q`` (seq, head, rows, d) dotted with every key of ``k`` (kseq, khead, n_kv, d), both
    holding F16 values, as ``ggml_vec_dot_f16`` computes each dot (:func:`.fdot.vec_dot`).  Query head h reads key
    head h // rh, sequence s key sequence s // rs."""
    n_seq, n_head, rows, _ = q.shape
    out = np.empty((n_seq, n_head, rows, k.shape[2]), dtype=np.float32)
    for s, h in np.ndindex(n_seq, n_head):
        out[s, h] = fdot.vec_dot(k[s // rs, h // rh], q[s, h], "f16")
    return out


def _expf(x: np.ndarray) -> np.ndarray:
    return expf(np.asarray(x, dtype=np.float32))


def _softmax_v(scores: np.ndarray, v: np.ndarray, sinks: np.ndarray | None, rh: int, rs: int) -> np.ndarray:
    mx = scores.max(axis=-1)
    if sinks is not None:
        mx = np.maximum(mx, sinks)
    mx = np.where(np.isneginf(mx), np.float32(0), mx)
    w = np.exp(scores - mx[..., None])
    total = w.sum(axis=-1, dtype=np.float32)
    if sinks is not None:
        total = total + np.exp(sinks - mx)
    out = broadcast_matmul(w, v, rh, rs)
    inv = np.divide(np.float32(1), total, out=np.zeros_like(total), where=total != 0)
    return (out * inv[..., None]).astype(np.float32)


def _online_f16(scores: np.ndarray, v: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """ggml's one-chunk recurrence with an F16 accumulator, stepping over KV positions, all rows at once.

    Only the F16 rounding of the accumulator after every step is sequential: the running maximum, and with it every
    step's rescale factor ``ms`` and weight ``vs``, is worked out for all positions at once, so each step costs a
    handful of numpy calls on one (rows, dv) slice.
    """
    lead = scores.shape[:-1]
    live = ~np.isneginf(scores)
    # Positions masked out (-inf) for every row change nothing: only the others are stepped through.
    keep = np.flatnonzero(live.any(axis=tuple(range(live.ndim - 1))))
    acc = np.zeros((*lead, v.shape[-1]), dtype=np.float16)
    total = np.zeros(lead, dtype=np.float32)
    big_m = np.full(lead, -np.inf, dtype=np.float32)
    if len(keep):
        acc, total, big_m = _online_steps(scores, v, live, keep)
    out = acc.astype(np.float32)
    if sinks is not None:
        sink_max = sinks > big_m
        with np.errstate(invalid="ignore", over="ignore"):
            ms = np.where(sink_max, _expf(big_m - sinks), np.float32(1)).astype(np.float32)
            vs = np.where(sink_max, np.float32(1), _expf(sinks - big_m)).astype(np.float32)
        out = out * ms[..., None]
        total = (total.astype(np.float64) * ms + vs).astype(np.float32)  # fused, as in the loop
    inv = np.divide(np.float32(1), total, out=np.zeros_like(total), where=total != 0)
    return (out * inv[..., None]).astype(np.float32)


def _online_steps(scores: np.ndarray, v: np.ndarray, live: np.ndarray,
                  keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The accumulator, the softmax denominator and the final maximum after stepping over positions ``keep``."""
    lead = scores.shape[:-1]
    s = np.moveaxis(scores[..., keep], -1, 0)  # (P, *lead)
    use = np.moveaxis(live[..., keep], -1, 0)
    running = np.maximum.accumulate(np.where(use, s, -np.inf), axis=0)
    before = np.concatenate([np.full((1, *lead), -np.inf, dtype=np.float32), running[:-1]])
    new_max = use & (s > before)
    with np.errstate(invalid="ignore", over="ignore"):
        # expf as the C library computes it (numpy's float32 exp differs from it now and then).
        ms = np.where(new_max, _expf(before - s), np.float32(1)).astype(np.float32)
        vs = np.where(new_max | ~use, np.float32(1), _expf(s - before)).astype(np.float32)
    vs = np.where(use, vs, np.float32(0))
    rescale = new_max.any(axis=tuple(range(1, new_max.ndim))).tolist()
    dv = v.shape[-1]
    n_rows = int(np.prod(lead))
    # The steps work on flat rows: a numpy call on one flat array costs less than on its (seq, head, rows, dv) form,
    # and there is one call per KV position.
    acc = np.zeros(n_rows * dv, dtype=np.float16)
    ms_flat, vs_flat = ms.reshape(len(keep), n_rows), vs.reshape(len(keep), n_rows)
    chunk = max(1, _CHUNK_SCORES // max(1, n_rows * dv))
    for lo in range(0, len(keep), chunk):
        hi = min(len(keep), lo + chunk)
        # Every step's weighted V row, (chunk, *lead, dv), in float64: the product of an F16 value and a float32
        # weight is exact there, so adding it to the accumulator and rounding once to float32 is the fused
        # multiply-add of ggml_vec_mad_f16; a row not used at a step adds an exact zero.
        v_pos = np.moveaxis(v[..., keep[lo:hi], :], -2, 0)[:, :, :, None, :]  # (chunk, seq, head, 1, dv)
        with np.errstate(invalid="ignore"):
            weighted = np.where(use[lo:hi, ..., None], v_pos.astype(np.float64) * vs[lo:hi, ..., None],
                                np.float64(0))
        weighted = weighted.reshape(hi - lo, n_rows * dv)
        ms_wide = np.repeat(ms_flat[lo:hi], dv, axis=1)  # each row's factor over its dv values, every step at once
        for i in range(lo, hi):
            if rescale[i]:
                # Rows without a new maximum have ms == 1, which leaves their F16 values exactly as they are, so
                # one multiply (in float32, rounded to F16 on the way out) rescales just the rows that need it.
                np.multiply(acc, ms_wide[i - lo], out=acc, casting="unsafe")
            # Fused: added in float64, rounded to float32 (the FMA's result), then to F16 on the way out.
            acc[...] = (acc + weighted[i - lo]).astype(np.float32)
    return acc.reshape(*lead, dv), _denominators(ms_flat, vs_flat, rescale).reshape(lead), running[-1]


def _denominators(ms: np.ndarray, vs: np.ndarray, rescale: list[bool]) -> np.ndarray:
    """Each row's ``total = total * ms + vs`` over the steps, in float32 and in order, as ggml sums it.

    Between two rescaling steps every factor is 1, so the recurrence is a plain running sum: one ``accumulate``
    (sequential, hence rounded step by step like the loop) per stretch instead of one call per step.
    """
    total = np.zeros(ms.shape[1], dtype=np.float32)
    starts = [i for i, r in enumerate(rescale) if r]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    for a, b in zip(starts, [*starts[1:], len(rescale)], strict=True):
        stretch = np.empty((b - a, ms.shape[1]), dtype=np.float32)
        # S = S * ms + vs, which the compiler fuses into one multiply-add: rounded once.
        stretch[0] = (total.astype(np.float64) * ms[a] + vs[a]).astype(np.float32)
        stretch[1:] = vs[a + 1 : b]
        total = np.add.accumulate(stretch, axis=0)[-1]
    return total
