"""MUL_MAT, MUL_MAT_ID and OUT_PROD.

ggml's CPU backend converts src1 to the weight type's vec-dot type (Q8_0, Q8_1, Q8_K, F16, BF16 or F32) before
the dot products.  Where the executor has upstream's arithmetic for a type (:func:`_exact`), the product is
computed in it by compiled loops (:mod:`.q8dot`, :mod:`.kdot`, :mod:`.lowbit_dot`, :mod:`.fdot`); elsewhere it is a
float32 BLAS call on the dequantised weights and the converted activations, which agrees with ggml's within its own
test tolerances.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from ggml_rpc.spec import TYPES, GgmlOp, type_name

from ..graph import GraphTensor
from . import fdot, kdot, lowbit_dot
from .core import FLOATS, READABLE, convert, kernel, need_types, prepared, read, read_index, src, write
from .kdot import K_TYPES
from .lowbit_dot import LOWBIT_TYPES
from .memory import BF16, F16, F32, Memory, node_error
from .q8dot import EXACT_TYPES, TokenProduct, pack_weights, packed_size, products, raw_products
from .types import Q8_1, VEC_DOT_TYPE, q8_1_sum_error, through_type


def _as_vec_dot(node: GraphTensor, weight_type: int, b: np.ndarray) -> np.ndarray:
    vt = VEC_DOT_TYPE.get(weight_type)
    if vt is None:
        raise node_error(node, f"no dot product for weights of type {type_name(weight_type)}")
    if vt != F32 and b.shape[-1] % TYPES[vt].blck:
        raise node_error(node, f"row length {b.shape[-1]} is not a multiple of the {type_name(vt)} block size")
    return through_type(vt, np.ascontiguousarray(b, dtype=np.float32))


def _operands(node: GraphTensor) -> tuple[GraphTensor, GraphTensor, int, int, int, int, int, int, int]:
    """MUL_MAT's sources and sizes (k, m, n, ne02, ne03, ne12, ne13), every check the kernel makes on shapes and
    types done (raises :class:`ExecutorError` naming the node)."""
    a_t, b_t = src(node, 0), src(node, 1)
    need_types(node, a_t, READABLE, "source 0")
    need_types(node, b_t, FLOATS, "source 1")
    k, m, ne02, ne03 = (int(n) for n in a_t.ne)
    k1, n, ne12, ne13 = (int(x) for x in b_t.ne)
    if k != k1 or ne02 == 0 or ne03 == 0 or ne12 % ne02 or ne13 % ne03:
        raise node_error(node, "sources do not multiply (ne0 must match, src1 dims 2/3 multiples of src0's)")
    if tuple(node.ne) != (m, n, ne12, ne13) or node.type != F32:
        raise node_error(node, "result must be F32 [src0.ne1, src1.ne1, src1.ne2, src1.ne3]")
    return a_t, b_t, k, m, n, ne02, ne03, ne12, ne13


def _exact_product(mem: Memory, a_t: GraphTensor, rows: np.ndarray, batch: bool,
                   out: np.ndarray | None = None) -> np.ndarray:
    """``rows @ w^T`` in upstream's arithmetic (:mod:`.q8dot`, :mod:`.kdot`), the weights in their packed form kept
    between graphs like the float32 conversions; the 8-bit types' weights that the cache has no room for are read
    from their blocks instead (:func:`.q8dot.raw_products`).  Float weights write into ``out`` when it is given
    (the other types return their own array)."""
    if a_t.type in (F32, F16, BF16):
        w = read(mem, a_t) if a_t.type == F32 else mem.converted(a_t, partial(convert, a_t.type))
        return fdot.products(w[0, 0], rows, half=a_t.type == F16, batch=batch, brain=a_t.type == BF16, out=out)
    if a_t.type in K_TYPES:
        packed = mem.converted(a_t, lambda raw: kdot.pack_weights(a_t.type, raw[0, 0]), kind="kdot")
        return kdot.products(a_t.type, packed, rows, int(a_t.ne[1]))
    if a_t.type in LOWBIT_TYPES:
        packed = mem.converted(a_t, lambda raw: lowbit_dot.pack_weights(a_t.type, raw[0, 0]), kind="lowbit")
        return lowbit_dot.products(a_t.type, packed, rows, vector=mem.build.q2_0_vector)
    m = int(a_t.ne[1])
    packed = mem.converted(a_t, lambda raw: pack_weights(a_t.type, raw[0, 0]), kind="q8dot",
                           size=packed_size(m, int(a_t.ne[0])))
    if packed is None:  # not kept (too large for the cache, or written by the graph): from the blocks themselves
        return raw_products(a_t.type, mem.raw(a_t)[0, 0], rows, batch=batch)
    return products(a_t.type, packed, rows, m, batch=batch)


def _exact(a_t: GraphTensor, b_t: GraphTensor, k: int, ne02: int, ne03: int) -> bool:
    """Whether this product goes through :func:`_exact_product` (one weight matrix, whole blocks).

    F32, F16 and BF16 weights take it whenever src1 is F32: one token through their compiled vector dot, which
    reads the weights as fast as single-threaded BLAS's matrix-vector product (32,000 x 256 F32: 0.84 against
    0.93 ms), a batch through tinyBLAS's tiled loop, as fast as BLAS for the batches of generation and short prompts
    (2048 x 2048 F32 by 14 rows: 1.6 against 1.7-1.9 ms; 5632 x 2048: 4.4 against 5.1-6.8) and 2.5 times slower for
    long prompts (4096 x 4096 by 512: 180 against 72-137 ms), as upstream's own single-threaded loop is.  A batch of
    F32 weights with a non-contiguous src1 takes upstream's vector dot (see the kernel)."""
    if ne02 != 1 or ne03 != 1:
        return False
    if a_t.type in (F32, F16, BF16):
        return b_t.type == F32
    return _exact_type(a_t.type, k)


def _exact_type(type_id: int, k: int) -> bool:
    """Whether the executor computes a product of ``type_id`` weights with rows of ``k`` in upstream's order."""
    if type_id in (F32, F16, BF16):
        return True
    if type_id in LOWBIT_TYPES:
        return k % LOWBIT_TYPES[type_id] == 0
    return (type_id in EXACT_TYPES and k % 32 == 0) or (type_id in K_TYPES and k % 256 == 0)


@kernel(GgmlOp.MUL_MAT, src=READABLE, dst=(F32,), note="src1 F32/F16/BF16; broadcast over dims 2 and 3; F32, F16, BF16 "
        "(src1 F32), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "IQ4_NL, MXFP4, Q1_0, Q2_0, Q2_K-Q6_K, IQ4_XS, TQ1_0, TQ2_0, IQ2_XXS/XS/S and IQ3_XXS/S in the order of "
        "upstream's AVX2 kernels")
def _mul_mat(node: GraphTensor, mem: Memory) -> None:
    # dst[i0, i1, i2, i3] = sum_k src0[k, i0, i2 / r2, i3 / r3] * src1[k, i1, i2, i3]
    a_t, b_t, k, _m, n, ne02, ne03, ne12, ne13 = _operands(node)
    if _exact(a_t, b_t, k, ne02, ne03):
        out = mem.raw(node)
        if out.size:
            rows = np.ascontiguousarray(read(mem, b_t), dtype=np.float32).reshape(-1, k)
            # Upstream runs its batch kernel per (i12, i13) slice of n rows, its one-token kernel for n == 1; F32
            # weights take the batch kernel only for a contiguous src1 (ggml_compute_forward_mul_mat's src1_cont).
            batch = n > 1 and (a_t.type != F32 or bool(mem.raw(b_t).flags.c_contiguous))
            direct = out.reshape(-1, out.shape[-1]) if out.flags.c_contiguous else None
            res = _exact_product(mem, a_t, rows, batch=batch, out=direct)
            if res is not direct:
                np.copyto(out, res.reshape(out.shape))
        return
    # Weights converted to float32 once and reused by later runs while their buffer is not written (the per-token
    # logits matmul of a Q8_0 model otherwise dequantises 8 MB every token).
    a = read(mem, a_t) if a_t.type == F32 else mem.converted(a_t, partial(convert, a_t.type))  # (ne03, ne02, m, k)
    b = b_f32 = read(mem, b_t)  # (ne13, ne12, n, k)
    if a_t.type != F32:
        b = _as_vec_dot(node, a_t.type, b)
    out = mem.raw(node)
    if out.size == 0:
        return
    r2, r3 = ne12 // ne02, ne13 // ne03
    _products(out, a, b, n, r2, r3)
    if VEC_DOT_TYPE.get(a_t.type) == Q8_1:
        out += _sum_correction(mem.raw(a_t), b_f32, r2, r3)


def _sum_correction(raw_weights: np.ndarray, b: np.ndarray, r2: int, r3: int) -> np.ndarray:
    """What ggml's Q4_1/Q5_1 x Q8_1 dot products add to the dequantised product: each weight block's min times the
    FP16 rounding of the activation block's stored sum (:func:`~.types.q8_1_sum_error`)."""
    # block_q4_1 / block_q5_1 start with d and m, both FP16: the mins are bytes 2-3 of every block.
    mins = np.ascontiguousarray(raw_weights[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)  # (.., m, nb)
    err = q8_1_sum_error(b)  # (.., n, nb)
    if r2 == 1 and r3 == 1:
        return np.matmul(err, mins.swapaxes(-1, -2))
    return broadcast_matmul(err, mins.swapaxes(-1, -2), r2, r3)


def _products(out: np.ndarray, a: np.ndarray, b: np.ndarray, n: int, r2: int, r3: int) -> None:
    """``out = b @ a^T`` with ``a`` broadcast over ``b``'s dims 2 and 3 by ``r2``, ``r3``."""
    if r2 == 1 and r3 == 1:
        if n > 1:
            np.copyto(out, weights_left(a, b).swapaxes(-1, -2))
        elif streams_short_rows(a, b, out):
            pass
        elif out.flags.c_contiguous:
            np.matmul(b, a.swapaxes(-1, -2), out=out)
        else:
            np.copyto(out, np.matmul(b, a.swapaxes(-1, -2)))
        return
    np.copyto(out, broadcast_matmul(b, a.swapaxes(-1, -2), r2, r3))


#: A matrix-vector product of at least _STREAMED bytes of rows no longer than _SHORT_ROWS goes through einsum.
_SHORT_ROWS = 512
_STREAMED = 16 << 20
#: Products up to this many multiply-adds (m x n x k) per BLAS call take OpenBLAS's small-matrix path, which reads
#: the weights once instead of packing them first (measured on this kit's SkylakeX build: a block of 64 rows of 2048
#: times 7 columns ran at 11.6 GB/s of weights, of 64 rows times 8 columns at 6.9 GB/s).
_SMALL_PRODUCT = 1_000_000
_MIN_BLOCK_ROWS = 16


def streams_short_rows(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """One row of ``b`` through a large matrix ``a`` of short rows (a small model's output over a large vocabulary)
    into ``out``, with numpy's own sum-of-products loop; False (nothing done) for any other product.

    OpenBLAS's matrix-vector product reads such rows at half the speed einsum streams them here (32,000 x 256 F32
    from memory: 3.0 ms against 1.5 ms; 32,000 x 512: 5.1 against 2.8 ms); long rows stay with BLAS (32,000 x 2,048:
    12.3 against 13.2 ms), and so do matrices small enough to stay in cache between tokens, where BLAS is faster.
    """
    if not _short_rows(a, b, out):
        return False
    np.einsum("mk,k->m", a[0, 0], b[0, 0, 0], out=out.reshape(-1))
    return True


def _short_rows(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    return (a.shape[-1] <= _SHORT_ROWS and a.nbytes >= _STREAMED and a.shape[:-2] == (1, 1)
            and b.shape[:-1] == (1, 1, 1) and out.flags.c_contiguous)


def weights_left(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b^T`` as (..., m, n) for a batch of ``n`` > 1 rows of ``b``: the weights on the left, in blocks of rows.

    With the weights as the left operand OpenBLAS streams them instead of packing them for a narrow right side
    (1.5x faster at every batch of 2 to 256 rows measured); for a few rows (a short prompt), blocks small enough for
    BLAS's small-matrix path read them about twice as fast again (5 rows of 2048: 6.8 -> 14 GB/s, where one row
    reads at 21 GB/s).
    """
    bt = b.swapaxes(-1, -2)
    m, k = a.shape[-2:]
    n = b.shape[-2]
    rows = _SMALL_PRODUCT // max(1, n * k) // _MIN_BLOCK_ROWS * _MIN_BLOCK_ROWS
    if a.shape[:-2] != (1, 1) or b.shape[:-2] != (1, 1) or rows < _MIN_BLOCK_ROWS or rows >= m:
        return np.matmul(a, bt)
    a2, bt2 = a[0, 0], bt[0, 0]
    out = np.empty((m, n), dtype=np.float32)
    for i in range(0, m, rows):
        np.matmul(a2[i : i + rows], bt2, out=out[i : i + rows])
    return out[None, None]


@prepared(GgmlOp.MUL_MAT)
def _prepare_mul_mat(node: GraphTensor, mem: Memory) -> tuple[Callable[[], object], tuple] | None:
    """One token through a matrix (src1 a single F32 row, no broadcast), as the kernel computes it but with every
    check and view made once: a decoding step runs a dozen such products per layer, each a few microseconds of
    BLAS, which the kernel's checks otherwise outweighed several times over (35 us per 256 x 256 product)."""
    a_t, b_t, k, _m, n, ne02, ne03, ne12, ne13 = _operands(node)
    if n != 1 or (ne02, ne03, ne12, ne13) != (1, 1, 1, 1) or b_t.type != F32:
        return None
    out, b = mem.raw(node), mem.raw(b_t)
    if not out.flags.c_contiguous or out.size == 0:
        return None
    vt = VEC_DOT_TYPE.get(a_t.type)
    if vt is None or (vt != F32 and k % TYPES[vt].blck):
        return None  # the kernel refuses it, with its own message
    if _exact(a_t, b_t, k, ne02, ne03):
        rows = b.reshape(1, k)
        flat = out.reshape(1, -1)
        w = mem.raw(a_t)[0, 0]
        if a_t.type == F32 and fdot.direct(w, rows):
            # F32 weights are their buffer's live view: the compiled dot straight on it, no lookup per run (the
            # small products of a decoding step are a few microseconds each, as long as the calls around them).
            return fdot.f32_vec_dot, (w, rows, flat)
        if a_t.type in EXACT_TYPES and rows.strides[-1] == 4:
            return _token_q8(mem, a_t, rows, flat), ()

        def exact() -> None:
            res = _exact_product(mem, a_t, rows, batch=False, out=flat)
            if res is not flat:
                np.copyto(flat, res)

        return exact, ()
    conv = partial(convert, a_t.type)

    raw = mem.raw(a_t)
    summed = vt == Q8_1

    def converted_weights() -> None:
        # The conversion is looked up every run: it is dropped when the weight's buffer is written.
        w = mem.converted(a_t, conv)
        x = through_type(vt, np.ascontiguousarray(b))
        if not streams_short_rows(w, x, out):
            np.matmul(x, w.swapaxes(-1, -2), out=out)
        if summed:
            np.add(out, _sum_correction(raw, b, 1, 1), out=out)

    return converted_weights, ()


def _token_q8(mem: Memory, a_t: GraphTensor, rows: np.ndarray, flat: np.ndarray) -> Callable[[], None]:
    """One activation row through 8-bit-activation weights into ``flat``, as :func:`_exact_product` computes it,
    with the activation arrays and the packed weights' views kept between runs (:class:`.q8dot.TokenProduct`)."""
    m, k = (int(x) for x in a_t.ne[1::-1])
    token = TokenProduct(a_t.type, m, k, flat)
    size = packed_size(m, k)

    def pack(raw: np.ndarray) -> np.ndarray:
        return pack_weights(a_t.type, raw[0, 0])

    def run() -> None:
        packed = mem.converted(a_t, pack, kind="q8dot", size=size)
        if packed is None:  # not kept: from the blocks themselves
            np.copyto(flat, raw_products(a_t.type, mem.raw(a_t)[0, 0], rows, batch=False))
            return
        token(packed, rows)

    return run


def broadcast_matmul(b: np.ndarray, a_t: np.ndarray, r2: int, r3: int) -> np.ndarray:
    """``b[i3, i2] @ a_t[i3 // r3, i2 // r2]`` for every (i3, i2), without repeating ``a_t`` in memory.

    Row groups of ``b`` that share one matrix of ``a_t`` become an extra axis, so numpy broadcasts ``a_t`` over it.
    """
    n13, n12, n, _ = b.shape
    n03, n02, _, m = a_t.shape
    grouped = b.reshape(n03, r3, n02, r2, n, b.shape[-1])
    res = np.matmul(grouped, a_t[:, None, :, None])  # (n03, r3, n02, r2, n, m)
    return res.reshape(n13, n12, n, m)


@kernel(GgmlOp.MUL_MAT_ID, src=READABLE, dst=(F32,), note="expert ids I32, range-checked; each expert's product "
        "in upstream's one-token order for the types MUL_MAT has it for")
def _mul_mat_id(node: GraphTensor, mem: Memory) -> None:
    # dst[:, e, t] = as[:, :, ids[e, t]] @ b[:, e % ne11, t]
    as_t, b_t, ids_t = src(node, 0), src(node, 1), src(node, 2)
    need_types(node, as_t, READABLE, "source 0")
    need_types(node, b_t, FLOATS, "source 1")
    k, m, n_as, ne03 = (int(x) for x in as_t.ne)
    k1, ne11, ne12, ne13 = (int(x) for x in b_t.ne)
    n_used, n_tok = int(ids_t.ne[0]), int(ids_t.ne[1])
    if k != k1 or ne03 != 1 or ne13 != 1 or ne12 != n_tok or ne11 not in (1, n_used):
        raise node_error(node, "shapes do not fit MUL_MAT_ID (as [k, m, experts], b [k, used or 1, t], ids [used, t])")
    if tuple(node.ne) != (m, n_used, n_tok, 1) or node.type != F32:
        raise node_error(node, "result must be F32 [as.ne1, ids.ne0, ids.ne1, 1]")
    ids = read_index(mem, node, ids_t, n_as, "expert id")[0, 0]  # (tokens, used)
    b = b_f32 = read(mem, b_t)[0]  # (tokens, ne11, k)
    if as_t.type != F32:
        b = _as_vec_dot(node, as_t.type, b)
    summed = VEC_DOT_TYPE.get(as_t.type) == Q8_1
    out = np.zeros((n_tok, n_used, m), dtype=np.float32)
    # Upstream dots every (expert row, token) pair with the one-token kernel: exact where the executor has it.
    exact = _exact_type(as_t.type, k)
    for e in np.unique(ids):
        t_idx, u_idx = np.nonzero(ids == e)
        expert = _expert(as_t, int(e))
        if exact:
            rows = np.ascontiguousarray(b_f32[t_idx, u_idx % ne11], dtype=np.float32)
            out[t_idx, u_idx] = _exact_product(mem, expert, rows, batch=False)
            continue
        w = read(mem, expert)[0, 0]  # only the experts in use are read
        out[t_idx, u_idx] = b[t_idx, u_idx % ne11] @ w.T
        if summed:
            out[t_idx, u_idx] += _sum_correction(mem.raw(expert)[0, 0], b_f32[t_idx, u_idx % ne11], 1, 1)
    write(mem, node, out[None])


def _expert(as_t: GraphTensor, e: int) -> GraphTensor:
    """A GraphTensor for expert ``e`` (one dim-2 slice) of ``as_t``: its memory lies inside ``as_t``'s."""
    return GraphTensor(
        id=as_t.id, type=as_t.type, ne=(as_t.ne[0], as_t.ne[1], 1, 1), nb=as_t.nb, op=0,
        op_params=as_t.op_params, flags=0, name=f"{as_t.name}[{e}]", buffer=as_t.buffer,
        offset=as_t.offset + e * int(as_t.nb[2]),
    )


@kernel(GgmlOp.OUT_PROD, src=READABLE, dst=(F32,))
def _out_prod(node: GraphTensor, mem: Memory) -> None:
    # dst[i0, i1, i2, i3] = sum_k src0[i0, k, i2 / r2, i3 / r3] * src1[i1, k, i2, i3]
    a_t, b_t = src(node, 0), src(node, 1)
    need_types(node, b_t, FLOATS, "source 1")
    m, k, ne02, ne03 = (int(x) for x in a_t.ne)
    n, k1, ne12, ne13 = (int(x) for x in b_t.ne)
    ne2, ne3 = int(node.ne[2]), int(node.ne[3])
    if k != k1 or ne02 == 0 or ne03 == 0 or ne2 % ne02 or ne3 % ne03 or ne12 != ne2 or ne13 != ne3:
        raise node_error(node, "sources do not fit OUT_PROD")
    if tuple(node.ne[:2]) != (m, n):
        raise node_error(node, "result must be [src0.ne0, src1.ne0, ...]")
    a = read(mem, a_t)  # (ne03, ne02, k, m)
    b = read(mem, b_t)  # (ne3, ne2, k, n)
    a = np.repeat(np.repeat(a, ne2 // ne02, axis=1), ne3 // ne03, axis=0)
    write(mem, node, np.matmul(b.swapaxes(-1, -2), a))
