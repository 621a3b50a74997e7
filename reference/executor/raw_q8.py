"""The 8-bit-activation products read straight from the weights' blocks, compiled (numba): for weights too large
for the conversion cache, which would otherwise be packed anew (:func:`.compiled.decode_q8_rows`) every graph.

Each weight row is decoded once, in the elements' own order, into a row of codes that stays in the processor's
cache; the products and their accumulation are the packed form's loop (:func:`.lanes8._q8_blocks`, over codes in
the elements' own order), so the results are the packed form's bit for bit.
Imported by :func:`.q8dot.raw_products` on first use.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from .cmath32 import half_value
from .compiled import F32, _q8_end
from .lanes8 import _q8_one_quads, _q8_one_quads4, _q8_two_quads, _q8_two_quads4


@njit(cache=True, nogil=True)
def raw_q8_products(raw: np.ndarray, size: int, scale_at: int, e8m0: bool, min_at: int, qh_at: int, qs_at: int,
                    nibbles: bool, table: np.ndarray, xq: np.ndarray, xd: np.ndarray,
                    xs: np.ndarray, two: bool, summed: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """:func:`.compiled.q8_products` read straight from the weights' blocks (raw uint8 (m, nb * size), described
    as for :func:`.compiled.decode_q8_rows`), with xq in the elements' own order: each weight row is decoded once
    into a row of codes that stays in the cache, for weights too large to keep in packed form."""
    # One copy of the loop per flag pair, each flag a constant in it (as in :func:`.compiled.q8_products`).
    if summed:
        if two:
            _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, xq, xd, xs, True, True,
                      out)
        else:
            _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, xq, xd, xs, False,
                      True, out)
    elif two:
        _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, xq, xd, xs, True, False,
                  out)
    else:
        _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, xq, xd, xs, False, False,
                  out)


@njit(cache=True, inline="always")
def _raw_rows(raw, size, scale_at, e8m0, min_at, qh_at, qs_at, nibbles, table, xq, xd, xs, two, summed,
              out):  # type: ignore[no-untyped-def]
    m = raw.shape[0]
    n, k = xq.shape
    nb = k // 32
    # Q4_0, Q4_1, Q5_0, Q5_1's codes are the value plus a constant: no lookup, so that the loop vectorises.
    first = np.int32(table[0])
    linear = True
    for v in range(32):
        linear = linear and np.int32(table[v]) == first + v
    last = nb - nb % 2 if two else nb
    # The decoded weight row as a one-row matrix (the block loop's and _q8_end's form, shared with the packed
    # weights), and a plain view of each row for the decoders; all made once.
    codes2, wd2, wm2 = np.empty((1, k), dtype=np.int8), np.empty((1, nb), dtype=F32), np.zeros((1, nb), dtype=F32)
    codes, wd, wm = codes2[0], wd2[0], wm2[0]
    lanes = np.empty(32, dtype=F32)
    for c in range(m):
        row = raw[c]
        _row_scales(row, nb, size, scale_at, e8m0, min_at, wd, wm)
        # One branch-free decoding loop per block layout, chosen once a row: runtime tests inside the block loop
        # kept LLVM from vectorising it (it took five times the product's time).
        if not nibbles:
            _bytes(row, nb, size, qs_at, codes)
        elif qh_at < 0 and linear:
            _nibbles(row, nb, size, qs_at, first, codes)
        elif qh_at < 0:
            _nibbles_table(row, nb, size, qs_at, table, codes)
        else:  # Q5_0, Q5_1 (the 5-bit layouts are all linear)
            _fives(row, nb, size, qs_at, qh_at, first, codes)
        r = 0
        while r < n:
            rn = 4 if r + 4 <= n else 1
            if rn == 4:
                if two:
                    _q8_two_quads4(codes2, wd2, 0, xq, xd, r, last, lanes)
                else:
                    _q8_one_quads4(codes2, wd2, 0, xq, xd, r, last, lanes)
            elif two:
                _q8_two_quads(codes2, wd2, 0, xq, xd, r, last, lanes)
            else:
                _q8_one_quads(codes2, wd2, 0, xq, xd, r, last, lanes)
            for b in range(rn):
                out[r + b, c] = _q8_end(codes2, wd2, wm2, xq, xd, xs, 0, r + b, nb, last, summed, lanes, 8 * b)
            r += rn


@njit(cache=True, inline="always")
def _row_scales(row, nb, size, scale_at, e8m0, min_at, wd, wm):  # type: ignore[no-untyped-def]
    # Each block's scale (fp16, or MXFP4's E8M0 exponent) and min (fp16) as float32.
    for b in range(nb):
        o = b * size
        if e8m0:
            wd[b] = F32(math.ldexp(1.0, np.int32(row[o + scale_at]) - 128))
        else:
            wd[b] = half_value(np.uint16(np.int32(row[o + scale_at]) | (np.int32(row[o + scale_at + 1]) << 8)))
        if min_at >= 0:
            wm[b] = half_value(np.uint16(np.int32(row[o + min_at]) | (np.int32(row[o + min_at + 1]) << 8)))


@njit(cache=True, inline="always")
def _bytes(row, nb, size, qs_at, codes):  # type: ignore[no-untyped-def]
    # Q8_0: the codes are the block's bytes.
    for b in range(nb):
        _copy_block(row, b * size + qs_at, codes, b * 32)


@njit(cache=True, inline="always")
def _nibbles(row, nb, size, qs_at, first, codes):  # type: ignore[no-untyped-def]
    # Q4_0, Q4_1: element j < 16 the low nibble of byte j, j + 16 its high nibble; plus the table's first code.
    for b in range(nb):
        _nibble_block(row, b * size + qs_at, first, np.int32(0), codes, b * 32)


def _block_decoder(fives: bool):  # type: ignore[no-untyped-def]
    """An intrinsic decoding one block's 32 codes (as 16-wide vector operations: LLVM left the scalar loop
    unvectorised, five times the product's time): codes[at + j] = (low nibble of row[q + j]) + first and
    codes[at + 16 + j] = (high nibble) + first for j < 16, with ``fives`` bit j (j + 16) of qh as the fifth bit."""

    @intrinsic
    def nibble_block(typingctx, row, q, first, qh, codes, at):  # type: ignore[no-untyped-def]
        sig = types.void(row, q, first, qh, codes, at)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i8, i32 = ir.IntType(8), ir.IntType(32)
            v16b, v16i = ir.VectorType(i8, 16), ir.VectorType(i32, 16)
            src = context.make_array(signature.args[0])(context, builder, args[0])
            dst = context.make_array(signature.args[4])(context, builder, args[4])
            packed = builder.load(builder.bitcast(builder.gep(src.data, [args[1]]), v16b.as_pointer()), align=1)
            halves = [builder.and_(packed, ir.Constant(v16b, [15] * 16)),
                      builder.lshr(packed, ir.Constant(v16b, [4] * 16))]
            if fives:
                bits = context.cast(builder, args[3], signature.args[3], types.int32)
                one = builder.insert_element(ir.Constant(v16i, None), bits, ir.Constant(i32, 0))
                qh = builder.shuffle_vector(one, one, ir.Constant(v16i, [0] * 16))
                for h in range(2):
                    bit = builder.and_(builder.lshr(qh, ir.Constant(v16i, list(range(16 * h, 16 * h + 16)))),
                                       ir.Constant(v16i, [1] * 16))
                    halves[h] = builder.or_(halves[h], builder.trunc(builder.shl(bit, ir.Constant(v16i, [4] * 16)),
                                                                     v16b))
            low = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int32), i8)
            one = builder.insert_element(ir.Constant(v16b, None), low, ir.Constant(i32, 0))
            offset = builder.shuffle_vector(one, one, ir.Constant(v16i, [0] * 16))
            for h in range(2):
                where = builder.gep(dst.data, [builder.add(args[5], ir.Constant(args[5].type, 16 * h))])
                builder.store(builder.add(halves[h], offset), builder.bitcast(where, v16b.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return nibble_block


_nibble_block, _five_block = _block_decoder(fives=False), _block_decoder(fives=True)


@intrinsic
def _copy_block(typingctx, row, q, codes, at):  # type: ignore[no-untyped-def]
    """codes[at:at + 32] = row[q:q + 32] as one 32-byte vector (the scalar loop was not vectorised either)."""
    sig = types.void(row, q, codes, at)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        v32b = ir.VectorType(ir.IntType(8), 32).as_pointer()
        src = context.make_array(signature.args[0])(context, builder, args[0])
        dst = context.make_array(signature.args[2])(context, builder, args[2])
        block = builder.load(builder.bitcast(builder.gep(src.data, [args[1]]), v32b), align=1)
        builder.store(block, builder.bitcast(builder.gep(dst.data, [args[3]]), v32b), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _nibbles_table(row, nb, size, qs_at, table, codes):  # type: ignore[no-untyped-def]
    # IQ4_NL, MXFP4: each nibble looked up in the type's table of codes.
    for b in range(nb):
        q = b * size + qs_at
        for j in range(16):
            v = np.int32(row[q + j])
            codes[b * 32 + j] = table[v & 15]
            codes[b * 32 + 16 + j] = table[v >> 4]


@njit(cache=True, inline="always")
def _fives(row, nb, size, qs_at, qh_at, first, codes):  # type: ignore[no-untyped-def]
    # Q5_0, Q5_1: the nibbles with a fifth bit from the block's 32-bit qh (bit j for element j).
    for b in range(nb):
        h = b * size + qh_at
        qh = (np.int32(row[h]) | (np.int32(row[h + 1]) << 8) | (np.int32(row[h + 2]) << 16)
              | (np.int32(row[h + 3]) << 24))
        _five_block(row, b * size + qs_at, first, qh, codes, b * 32)
