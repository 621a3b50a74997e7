"""FLASH_ATTN_EXT: softmax(scale * Q K^T [softcapped] + slope * mask) V, per head, with K/V heads broadcast.

ggml's CPU backend (the one-query-at-a-time path) converts Q to K's vec-dot type, walks the KV positions in
order with an online softmax, and for an F16 V keeps the running weighted sum in F16 (rounded after every
step); positions whose mask is -inf are skipped.  That recurrence is compiled in :mod:`.flash_steps`, one query
row at a time as ggml runs it; for 64 or more query rows with F16/F32 K and V ggml takes its tiled path (64 by 64
tiles, float32 scores without converting Q), compiled tile for tile in :mod:`.flash_steps` too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from . import fdot
from .core import READABLE, convert, kernel, need_types, params_f32, prepared, read, src, write
from .matmul import broadcast_matmul
from .memory import BF16, F16, F32, Memory, node_error
from .q8dot import EXACT_TYPES, raw_products
from .softmax import alibi_slopes, broadcast_mask
from .types import VEC_DOT_TYPE, through_type

_TILE_ROWS = 64
_CHUNK_SCORES = 1 << 22


def _checked(node: GraphTensor) -> tuple[tuple[int, ...], np.float32, float, np.float32]:
    """FLASH_ATTN_EXT's checks on types and shapes: ((dk, n_q, n_head, n_seq, dv, n_kv, n_head_kv, k3), scale,
    max_bias, softcap), the scale already divided by a softcap."""
    q_t, k_t, v_t = src(node, 0), src(node, 1), src(node, 2)
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
    return (dk, n_q, n_head, n_seq, dv, n_kv, n_head_kv, k3), scale, max_bias, softcap


def _extras(node: GraphTensor, mem: Memory, dims: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The mask (its raw view cut to the rows and columns the scores use: a decoding step's mask is padded to many
    rows) and the sinks (raw view), each None when absent, after their checks."""
    _dk, n_q, n_head, n_seq, _dv, n_kv, _hkv, _k3 = dims
    mask_t, sinks_t = node.src[3], node.src[4]
    mask = sinks = None
    if mask_t is not None:
        need_types(node, mask_t, (F16, F32), "mask")
        mask = mem.raw(mask_t)
        broadcast_mask(node, mask, n_q, n_head, n_seq, n_kv, 0, 0)  # shape check before any work
        mask = mask[:, :, :n_q, :n_kv]
    if sinks_t is not None:
        need_types(node, sinks_t, (F32,), "sinks")
        if sinks_t.ne[0] < n_head:
            raise node_error(node, "sinks need one value per head")
        sinks = mem.raw(sinks_t)
    return mask, sinks


@prepared(GgmlOp.FLASH_ATTN_EXT)
def _prepare_decoding(node: GraphTensor, mem: Memory) -> tuple[Callable[[], None], tuple] | None:
    """A decoding step's attention (F16 K and V with contiguous rows, fewer query rows than the tiled path takes):
    every check, view and constant once, then per run the queries rounded to F16, the mask's live rows and the
    compiled recurrence (the kernel's Python around that loop was half of its 20 us)."""
    dims, scale, max_bias, softcap = _checked(node)
    _dk, n_q, n_head, n_seq, dv, _n_kv, n_head_kv, k3 = dims
    q_t, k_t, v_t = src(node, 0), src(node, 1), src(node, 2)
    k_raw, v_raw = mem.raw(k_t), mem.raw(v_t)
    if (k_t.type != F16 or v_t.type != F16 or n_q >= _TILE_ROWS or k_raw.strides[-1] != 2
            or v_raw.strides[-1] != 2 or not n_q * n_head * n_seq * dv):
        return None
    from .flash_steps import attend_f16

    mask = np.zeros((1, 1, 1, 1), dtype=np.float32)
    no_sinks = np.zeros(n_head, dtype=np.float32)
    mask_raw, sinks_raw = _extras(node, mem, dims)  # views: read each run, as every input
    q_raw, k16, v16, dst = mem.raw(q_t), k_raw.view(np.uint16), v_raw.view(np.uint16), mem.raw(node)
    rh, rs = n_head // n_head_kv, n_seq // k3
    slopes = alibi_slopes(n_head, max_bias)
    out = np.empty((n_seq, n_head, n_q, dv), dtype=np.float32)

    def run() -> None:
        q = q_raw.astype(np.float16).astype(np.float32)  # ggml converts the queries to K's type
        the_mask = mask if mask_raw is None else np.ascontiguousarray(mask_raw, dtype=np.float32)
        sinks = no_sinks if sinks_raw is None else np.ascontiguousarray(sinks_raw.reshape(-1)[:n_head])
        attend_f16(q, k16, v16, rh, rs, the_mask, mask_raw is not None, slopes, float(scale), float(softcap), sinks,
                   sinks_raw is not None, out)
        np.copyto(dst, out.swapaxes(1, 2))

    return run, ()


@kernel(GgmlOp.FLASH_ATTN_EXT, src=READABLE, dst=(F32,), note="K/V F32, F16, BF16 or quantised; mask, softcap, sinks")
def _flash_attn_ext(node: GraphTensor, mem: Memory) -> None:
    dims, scale, max_bias, softcap = _checked(node)
    dk, n_q, n_head, n_seq, dv, n_kv, n_head_kv, k3 = dims
    q_t, k_t, v_t = src(node, 0), src(node, 1), src(node, 2)
    mask_t = node.src[3]

    q = read(mem, q_t)  # (n_seq, n_head, n_q, dk)
    tiled = n_q >= _TILE_ROWS and k_t.type == v_t.type and k_t.type in (F32, F16)
    online = v_t.type == F16 and not tiled
    # Quantised keys in upstream's own vector dot (the queries quantised by it, as ggml converts them); the other
    # types round the queries to the keys' vec-dot type here.
    blocks_dot = not tiled and k_t.type in EXACT_TYPES and dk % 32 == 0
    q_plain = q
    if not tiled and k_t.type != F32 and not blocks_dot:
        q = through_type(VEC_DOT_TYPE.get(k_t.type, F32), np.ascontiguousarray(q))
    rh, rs = n_head // n_head_kv, n_seq // k3
    mask_raw, sinks_raw = _extras(node, mem, dims)
    mask = None if mask_raw is None else convert(mask_t.type, mask_raw)
    sinks = None if sinks_raw is None else sinks_raw.reshape(-1)[:n_head][None, :, None]
    k_raw, v_raw = mem.raw(k_t), mem.raw(v_t)  # positions on axis 2 (plain and block layouts alike)
    if online and k_t.type == F16 and k_raw.strides[-1] == 2 and v_raw.strides[-1] == 2:
        # F16 K and V one query at a time (a decoding step): the whole loop compiled, scores included.
        out = _attend(False, q, k_raw, v_raw, rh, rs, mask, alibi_slopes(n_head, max_bias), scale, softcap, sinks)
        write(mem, node, out.swapaxes(1, 2))
        return
    if tiled:
        out = _attend(True, q, convert(k_t.type, k_raw), convert(v_t.type, v_raw), rh, rs, mask,
                      alibi_slopes(n_head, max_bias), scale, softcap, sinks)
        write(mem, node, out.swapaxes(1, 2))
        return
    if mask is not None:
        # ggml's one-query path skips a KV position whose mask is -inf before touching K or V: only positions some
        # row can see are converted and scored (a decoding step sees a few of a long cache).
        seen = np.flatnonzero(~np.isneginf(mask[:, :, :n_q, :n_kv]).all(axis=(0, 1, 2)))
        if len(seen) < n_kv:
            k_raw, v_raw = k_raw[:, :, seen], v_raw[:, :, seen]
            mask = mask[..., seen]
            n_kv = len(seen)
    k = None if blocks_dot else convert(k_t.type, k_raw)  # (k3, n_head_kv, n_kv, dk)
    v = convert(v_t.type, v_raw)  # (k3, n_head_kv, n_kv, dv)
    slopes = alibi_slopes(n_head, max_bias)[None, :, None, None] if max_bias > 0 else None
    out = np.empty((n_seq, n_head, n_q, dv), dtype=np.float32)
    # Query rows in chunks, so the score block stays small however long the context is.
    step = max(1, _CHUNK_SCORES // max(1, n_seq * n_head * n_kv))
    for lo in range(0, n_q, step):
        hi = min(n_q, lo + step)
        if blocks_dot:
            scores = _block_scores(k_t.type, k_raw, q_plain[:, :, lo:hi], rh, rs)
        else:
            scores = _float_scores(k_t.type, q[:, :, lo:hi], k, rh, rs)  # type: ignore[arg-type]
        scores *= scale
        if softcap != 0:
            from .flash_steps import softcapped

            softcapped(scores, float(softcap))
        if mask is not None:
            m = broadcast_mask(node, mask, n_q, n_head, n_seq, n_kv, lo, hi)
            mv = slopes * m if slopes is not None else m
            # A position the mask hides is skipped before its dot is taken, whatever its key row holds.
            scores = np.where(np.isneginf(mv), np.float32(-np.inf), scores + mv).astype(np.float32)
        out[:, :, lo:hi] = _online(scores, v, sinks, rh, rs, half=online)
    # Result layout is [dv, head, query, seq]: swap head and query.
    write(mem, node, out.swapaxes(1, 2))


def _float_scores(k_type: int, q: np.ndarray, k: np.ndarray, rh: int, rs: int) -> np.ndarray:
    """Every query row dotted with every key as ``ggml_vec_dot_f16``/``_f32``/``_bf16`` computes it (the queries
    already rounded to the keys' type), or by BLAS for a key type whose dot is not emulated."""
    kind = {F32: "f32", F16: "f16", BF16: "bf16"}.get(k_type)
    if kind is None:
        return broadcast_matmul(q, k.swapaxes(-1, -2), rh, rs)
    n_seq, n_head, rows, _ = q.shape
    out = np.empty((n_seq, n_head, rows, k.shape[2]), dtype=np.float32)
    for s, h in np.ndindex(n_seq, n_head):
        out[s, h] = fdot.vec_dot(k[s // rs, h // rh], q[s, h], kind)
    return out


def _block_scores(k_type: int, k_raw: np.ndarray, q: np.ndarray, rh: int, rs: int) -> np.ndarray:
    """Every query row dotted with every quantised key in upstream's own vector dot for the type
    (:func:`.q8dot.raw_products`, which quantises the queries to the type's activation blocks): (seq, head, rows,
    n_kv)."""
    n_seq, n_head, rows, _ = q.shape
    out = np.empty((n_seq, n_head, rows, k_raw.shape[2]), dtype=np.float32)
    for s, h in np.ndindex(n_seq, n_head):
        out[s, h] = raw_products(k_type, np.ascontiguousarray(k_raw[s // rs, h // rh]),
                                 np.ascontiguousarray(q[s, h], dtype=np.float32), batch=False)
    return out


def _online(scores: np.ndarray, v: np.ndarray, sinks: np.ndarray | None, rh: int, rs: int, *,
            half: bool) -> np.ndarray:
    """ggml's one-query recurrence for every row of ``scores`` (seq, head, rows, n_kv): with an F16 accumulator
    (``half``, an F16 V) or a float32 one (any other V), both :func:`.flash_steps.online_rows`.  Query head h
    reads V head h // rh of ``v`` (kseq, khead, n_kv, dv),
    sequence s V sequence s // rs; ``sinks`` (1, head, 1) or None."""
    from .flash_steps import online_rows

    n_seq, n_head, n_rows, n_kv = scores.shape
    k3, n_head_kv, _, dv = v.shape
    heads = (np.arange(n_seq)[:, None] // rs) * n_head_kv + np.arange(n_head)[None, :] // rh
    v_of = np.repeat(heads.reshape(-1), n_rows)
    flat_sinks = np.zeros(len(v_of), dtype=np.float32)
    if sinks is not None:
        flat_sinks = np.ascontiguousarray(np.broadcast_to(sinks.reshape(1, n_head, 1), (n_seq, n_head, n_rows)),
                                          dtype=np.float32).reshape(-1)
    out = np.empty((n_seq * n_head * n_rows, dv), dtype=np.float32)
    online_rows(np.ascontiguousarray(scores, dtype=np.float32).reshape(-1, n_kv),
                np.ascontiguousarray(v, dtype=np.float32).reshape(k3 * n_head_kv, n_kv, dv), v_of, flat_sinks,
                sinks is not None, half, out)
    return out.reshape(n_seq, n_head, n_rows, dv)


def _attend(tiled: bool, q: np.ndarray, k: np.ndarray, v: np.ndarray, rh: int, rs: int, mask: np.ndarray | None,
            slopes: np.ndarray, scale: np.float32, softcap: np.float32, sinks: np.ndarray | None) -> np.ndarray:
    """The node's arrays through :func:`.flash_steps.attend_tiled` (K and V as float32 values) or
    :func:`.flash_steps.attend_f16` (K and V as their F16 bits): (seq, head, rows, dv)."""
    from .flash_steps import attend_f16, attend_tiled

    n_seq, n_head, n_rows, _ = q.shape
    out = np.empty((n_seq, n_head, n_rows, v.shape[3]), dtype=np.float32)
    if out.size == 0:
        return out
    head_sinks = np.zeros(n_head, dtype=np.float32) if sinks is None else np.ascontiguousarray(sinks.reshape(-1))
    the_mask = np.zeros((1, 1, 1, 1), dtype=np.float32) if mask is None else mask
    if tiled:
        k, v = np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32)
    else:
        k, v = k.view(np.uint16), v.view(np.uint16)
    (attend_tiled if tiled else attend_f16)(np.ascontiguousarray(q, dtype=np.float32), k, v, rh, rs, the_mask,
                                            mask is not None, slopes, float(scale), float(softcap), head_sinks,
                                            sinks is not None, out)
    return out
