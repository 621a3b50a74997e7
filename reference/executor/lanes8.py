"""Eight float32 lanes as one 8-wide vector operation, LLVM intrinsics for the numba kernels: the 8-bit-activation
block loop with its accumulators in registers (:mod:`.compiled`, :mod:`.raw_q8`), the float vector dots' row loop
and tinyBLAS's tiles (:mod:`.float_kernels`), and eight F16 values converted (:mod:`.flash_steps`).

LLVM does not vectorise the same work written with scalars (eight lanes of four int32 products, each converted and
fused into its accumulator): it took three times as long.  The integer sums are exact in any order; the conversion
and the fused multiply-add are per lane, rounded once, as in ggml's AVX2 kernels.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def _fma_lanes(typingctx, w, x, i, acc, at):  # type: ignore[no-untyped-def]
    """acc[at + j] = w[i + j] * x[i + j] + acc[at + j] for j < 8, each rounded once: eight lanes of ggml's float
    vector dots as one vector fused multiply-add.  w, x and acc are float32 with contiguous elements (the kernels'
    callers make them so): the lanes are read as one vector from the first one's address."""
    sig = types.void(w, x, i, acc, at)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        v8f = ir.VectorType(ir.FloatType(), 8)

        def at_(k, index):  # type: ignore[no-untyped-def]
            arr = context.make_array(signature.args[k])(context, builder, args[k])
            return builder.bitcast(builder.gep(arr.data, [index]), v8f.as_pointer())

        where = at_(3, args[4])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8f, v8f]),
                                             "llvm.fma.v8f32")
        result = builder.call(fma, [builder.load(at_(0, args[2]), align=4), builder.load(at_(1, args[2]), align=4),
                                    builder.load(where, align=4)])
        builder.store(result, where, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _halves_to(typingctx, src, i, dst, at):  # type: ignore[no-untyped-def]
    """dst[at + j] = the F16 value of src[i + j] (uint16 bit patterns) for j < 8, exactly (one vector conversion, as
    ggml's F16C loads); src and dst have contiguous elements."""
    sig = types.void(src, i, dst, at)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        v8h, v8f = ir.VectorType(ir.HalfType(), 8), ir.VectorType(ir.FloatType(), 8)
        s = context.make_array(signature.args[0])(context, builder, args[0])
        d = context.make_array(signature.args[2])(context, builder, args[2])
        halves = builder.load(builder.bitcast(builder.gep(s.data, [args[1]]), v8h.as_pointer()), align=2)
        where = builder.bitcast(builder.gep(d.data, [args[3]]), v8f.as_pointer())
        builder.store(builder.fpext(halves, v8f), where, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _tile_fma(rm: int, rn: int):  # type: ignore[no-untyped-def]
    """An intrinsic running tinyBLAS's loop over a tile of ``rm`` weight rows by ``rn`` activation rows: for every
    i < whole (a multiple of 8), acc[8 (a rn + b) + j] = w[c + a, i + j] * x[r + b, i + j] + acc[...], one fused
    multiply-add per lane, rounded once.  Each output keeps its own chain of fused multiply-adds in the order
    tinyBLAS runs it, so the tile changes nothing but speed: the rm x rn chains are independent, which hides the
    multiply-add's latency (one chain at a time waited on it), and each loaded vector serves rn or rm outputs.
    The accumulators are read from acc at the start and written back at the end (kept in registers between); w and
    x are 2-D float32 arrays with contiguous elements in a row."""

    @intrinsic
    def tile_fma(typingctx, w, c, x, r, whole, acc):  # type: ignore[no-untyped-def]
        sig = types.void(w, c, x, r, whole, acc)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i64 = ir.IntType(64)
            v8f = ir.VectorType(ir.FloatType(), 8)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8f, v8f]),
                                                 "llvm.fma.v8f32")

            w_rows = _row_pointers(context, builder, signature.args[0], args[0], args[1], rm)
            x_rows = _row_pointers(context, builder, signature.args[2], args[2], args[3], rn)
            store = context.make_array(signature.args[5])(context, builder, args[5])
            slots = [builder.bitcast(builder.gep(store.data, [ir.Constant(i64, 8 * t)]), v8f.as_pointer())
                     for t in range(rm * rn)]
            start = [builder.load(s, align=4) for s in slots]

            def step(i, accs):  # type: ignore[no-untyped-def]
                xs = [builder.load(builder.bitcast(builder.gep(p, [i]), v8f.as_pointer()), align=4) for p in x_rows]
                nxt = []
                for a in range(rm):
                    wv = builder.load(builder.bitcast(builder.gep(w_rows[a], [i]), v8f.as_pointer()), align=4)
                    nxt += [builder.call(fma, [wv, xs[b], accs[a * rn + b]]) for b in range(rn)]
                return nxt

            accs = _counted_loop(builder, "tile", args[4], 8, start, step)
            for a, s in zip(accs, slots, strict=True):
                builder.store(a, s, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_fma


#: tinyBLAS tiles: eight or four weight rows by one to three activation rows.
_tile_4x1, _tile_4x2, _tile_4x3 = _tile_fma(4, 1), _tile_fma(4, 2), _tile_fma(4, 3)
_tile_8x1, _tile_8x2, _tile_8x3 = _tile_fma(8, 1), _tile_fma(8, 2), _tile_fma(8, 3)


@intrinsic
def _dot_row(typingctx, w, c, x, r, whole, lanes):  # type: ignore[no-untyped-def]
    """``ggml_vec_dot_f32``'s loop over weight row c and activation row r: four accumulators of eight lanes, for
    every i < whole (a multiple of 32) accumulator q updated with elements i + 8q .. i + 8q + 7 by one fused
    multiply-add a lane, rounded once; at the end the lanes, folded (0 + 2) + (1 + 3) as ggml folds them, are written
    to lanes[0:8].  The accumulators stay in registers for the whole row (kept in memory they cost a store and a
    reload per step: 0.92 against 0.82 ms for 32,000 rows of 256 with the weights out of cache).  One row at a time
    on purpose: tiles of 2, 4 or 8 rows, which share the activation loads, read the weights as that many streams and
    measured 1.5 to 2.6 times slower here on a matrix larger than the cache.  w and x are float32 arrays with
    contiguous elements in a row: 2-D, or 1-D for a single row (c or r then 0)."""
    sig = types.void(w, c, x, r, whole, lanes)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        v8f = ir.VectorType(ir.FloatType(), 8)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8f, v8f]), "llvm.fma.v8f32")
        w_row = _row_pointers(context, builder, signature.args[0], args[0], args[1], 1)[0]
        x_row = _row_pointers(context, builder, signature.args[2], args[2], args[3], 1)[0]
        store = context.make_array(signature.args[5])(context, builder, args[5])
        def step(i, accs):  # type: ignore[no-untyped-def]
            def vec(p, q):  # type: ignore[no-untyped-def]
                at = builder.add(i, ir.Constant(i64, 8 * q))
                return builder.load(builder.bitcast(builder.gep(p, [at]), v8f.as_pointer()), align=4)

            return [builder.call(fma, [vec(w_row, q), vec(x_row, q), accs[q]]) for q in range(4)]

        accs = _counted_loop(builder, "dot", args[4], 32, [ir.Constant(v8f, None)] * 4, step)
        folded = builder.fadd(builder.fadd(accs[0], accs[2]), builder.fadd(accs[1], accs[3]))
        builder.store(folded, builder.bitcast(store.data, v8f.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _row_pointers(context, builder, ty, value, first, count, element=None):  # type: ignore[no-untyped-def]
    # Pointers (to float32, or to ``element``) to rows first .. first + count of a 2-D array (any row stride,
    # contiguous elements); a 1-D array is its one row (first is then 0).
    arr = context.make_array(ty)(context, builder, value)
    to = (element or ir.FloatType()).as_pointer()
    if ty.ndim == 1:
        return [builder.bitcast(arr.data, to)]
    stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
    i64 = ir.IntType(64)
    return [builder.bitcast(builder.gep(base, [builder.mul(builder.add(first, ir.Constant(i64, j)), stride)]), to)
            for j in range(count)]


def _counted_loop(builder, name, limit, step, start, step_body):  # type: ignore[no-untyped-def]
    """Emit ``for (i = 0; i < limit; i += step) values = step_body(i, values)`` with the loop-carried values (LLVM
    vectors, from ``start``) in phi nodes, so that they stay in registers; returns their values after the loop."""
    i64 = ir.IntType(64)
    entry = builder.block
    head = builder.append_basic_block(f"{name}.head")
    body = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(i64)
    values = [builder.phi(v.type) for v in start]
    i.add_incoming(ir.Constant(i64, 0), entry)
    for phi, v in zip(values, start, strict=True):
        phi.add_incoming(v, entry)
    builder.cbranch(builder.icmp_signed("<", i, limit), body, done)
    builder.position_at_end(body)
    nxt = step_body(i, values)
    i.add_incoming(builder.add(i, ir.Constant(i64, step)), builder.block)
    for phi, v in zip(values, nxt, strict=True):
        phi.add_incoming(v, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return values


def _q8_blocks(two: bool, rm: int, quads: bool = False, rn: int = 1):  # type: ignore[no-untyped-def]
    """An intrinsic running the 8-bit-activation kernels' loop over blocks 0 .. last of weight rows c .. c + rm and
    activation rows r .. r + rn: per block and pair of rows the eight lane sums of its int8 products (codes in lane
    order, lane i's four at i, i + 8, i + 16, i + 24, or with ``quads`` in the elements' own order, lane i's at
    4i .. 4i + 3: exact integers), converted to float32 and fused into the pair's accumulator with the scale
    wd[c, b] * xd[r, b] (a float32 product), rounded once.  With ``two`` even blocks go to one accumulator and odd
    ones to another, added lane by lane at the end (last even).  The eight lanes of weight row a and activation row b
    are written to lanes[8t:8t + 8], t = a rn + b.  Products and accumulators stay in registers (the loop this
    replaced wrote every product to memory and reloaded the accumulators per block), the rm x rn chains of
    multiply-adds are independent, so one's latency hides another's, and each block of codes loaded serves rn or rm
    of them.  wq, xq: int8 rows, wd, xd: float32 rows, contiguous elements."""

    @intrinsic
    def q8_blocks(typingctx, wq, wd, c, xq, xd, r, last, lanes):  # type: ignore[no-untyped-def]
        sig = types.void(wq, wd, c, xq, xd, r, last, lanes)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
            v8f, v8i = ir.VectorType(ir.FloatType(), 8), ir.VectorType(i32, 8)
            v32b, v32h = ir.VectorType(i8, 32), ir.VectorType(ir.IntType(16), 32)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8f, v8f]),
                                                 "llvm.fma.v8f32")
            ty = signature.args
            w_rows = _row_pointers(context, builder, ty[0], args[0], args[2], rm, i8)
            wd_rows = _row_pointers(context, builder, ty[1], args[1], args[2], rm)
            x_rows = _row_pointers(context, builder, ty[3], args[3], args[5], rn, i8)
            xd_rows = _row_pointers(context, builder, ty[4], args[4], args[5], rn)
            store = context.make_array(ty[7])(context, builder, args[7])
            n_acc = 2 if two else 1
            def codes(row, o):  # type: ignore[no-untyped-def]
                at = builder.bitcast(builder.gep(row, [o]), v32b.as_pointer())
                return builder.sext(builder.load(at, align=1), v32h)

            v16i = ir.VectorType(i32, 16)
            if quads:  # lane i: elements 4i .. 4i + 3, pairs (2j, 2j + 1)
                first, second = list(range(0, 32, 2)), list(range(1, 32, 2))
            else:  # lane i: elements i, i + 8, i + 16, i + 24, pairs (i, i + 8) then (i + 16, i + 24)
                first, second = [*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)]
            take_a, take_b = ir.Constant(ir.VectorType(i32, 16), first), ir.Constant(ir.VectorType(i32, 16), second)
            lanes_a = ir.Constant(v8i, list(range(0, 16, 2)) if quads else list(range(8)))
            lanes_b = ir.Constant(v8i, list(range(1, 16, 2)) if quads else list(range(8, 16)))

            def block(blk, xs, w_row, wd_row, xd_row, acc):  # type: ignore[no-untyped-def]
                # Pairs of products summed in int32 (the form of a multiply-add of 16-bit pairs), then each lane's
                # two pairs: exact integers in any order.
                ws = codes(w_row, builder.mul(blk, ir.Constant(i64, 32)))

                def half(v, take):  # type: ignore[no-untyped-def]
                    return builder.sext(builder.shuffle_vector(v, v, take), v16i)

                pairs = builder.add(builder.mul(half(ws, take_a), half(xs, take_a)),
                                    builder.mul(half(ws, take_b), half(xs, take_b)))
                total = builder.add(builder.shuffle_vector(pairs, pairs, lanes_a),
                                    builder.shuffle_vector(pairs, pairs, lanes_b))
                scale = builder.fmul(builder.load(builder.gep(wd_row, [blk])), builder.load(builder.gep(xd_row, [blk])))
                one = builder.insert_element(ir.Constant(v8f, None), scale, ir.Constant(i32, 0))
                splat = builder.shuffle_vector(one, one, ir.Constant(v8i, [0] * 8))
                return builder.call(fma, [splat, builder.sitofp(total, v8f), acc])

            def step(b, accs):  # type: ignore[no-untyped-def]
                nxt = list(accs)
                for q in range(n_acc):
                    blk = builder.add(b, ir.Constant(i64, q))
                    for x in range(rn):
                        xs = codes(x_rows[x], builder.mul(blk, ir.Constant(i64, 32)))
                        for a in range(rm):
                            at = (a * rn + x) * n_acc + q
                            nxt[at] = block(blk, xs, w_rows[a], wd_rows[a], xd_rows[x], accs[at])
                return nxt

            accs = _counted_loop(builder, "q8", args[6], n_acc, [ir.Constant(v8f, None)] * (n_acc * rm * rn), step)
            for t in range(rm * rn):
                mine = accs[t * n_acc: t * n_acc + n_acc]
                result = builder.fadd(mine[0], mine[1]) if two else mine[0]
                where = builder.bitcast(builder.gep(store.data, [ir.Constant(i64, 8 * t)]), v8f.as_pointer())
                builder.store(result, where, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return q8_blocks


#: The 8-bit-activation block loop with one accumulator, or two alternating.
_q8_one, _q8_two = _q8_blocks(False, 1), _q8_blocks(True, 1)
_q8_one4, _q8_two4 = _q8_blocks(False, 4), _q8_blocks(True, 4)
#: The same over codes in the elements' own order (the raw-block products, :mod:`.raw_q8`).
_q8_one_quads, _q8_two_quads = _q8_blocks(False, 1, True), _q8_blocks(True, 1, True)
#: ... for four activation rows at a time (a batch: each weight block decoded once serves four).
_q8_one_quads4, _q8_two_quads4 = _q8_blocks(False, 1, True, 4), _q8_blocks(True, 1, True, 4)
