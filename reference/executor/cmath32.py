"""The C library's float32 ``expf``, ``cosf`` and ``sinf`` and F16 rounding, for compiled (numba) kernels.

Upstream's kernels call the C library's float functions, which are not correctly rounded (see :mod:`.libm`); a
compiled kernel that must give the same bits calls the very same functions.  Each intrinsic below is a plain call
to the library's symbol, declared by name, with no fast-math flag: LLVM neither vectorises nor rewrites it, and the
process's own C library answers (the one :mod:`.libm` asks through ctypes; tests/executor/test_cmath32.py compares
the two).  Imported only by compiled kernels, so that a process that never computes does not load numba.
"""

from __future__ import annotations

import ctypes.util

import numpy as np
from llvmlite import binding, ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

# The JIT resolves the symbols against libraries loaded into the process: make sure the C math library is one.
binding.load_library_permanently(ctypes.util.find_library("m") or "libm.so.6")

F32 = np.float32


def _unary(name: str):  # type: ignore[no-untyped-def]
    @intrinsic
    def call(typingctx, x):  # type: ignore[no-untyped-def]
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            f = ir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f]), name)
            return builder.call(fn, args)

        return sig, codegen

    return call


#: The C library's expf, cosf, sinf and tanhf of a float32 (as ggml's kernels call them).
expf = _unary("expf")
cosf = _unary("cosf")
sinf = _unary("sinf")
tanhf = _unary("tanhf")


@intrinsic
def bits(typingctx, x):  # type: ignore[no-untyped-def]
    # The float32's bit pattern as uint32.
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    # The uint32 bit pattern as float32.
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)
_HALF_OVERFLOW = np.uint32(0x477FF000)  # 65520: from here on a float32 rounds to an infinite F16
_HALF_NORMAL = np.uint32(0x38800000)  # 2^-14, the smallest normal F16
_LOW = np.uint32(0xFFF)
_KEEP = np.uint32(0xFFFFE000)


@njit(cache=True, inline="always")
def to_half(x):  # type: ignore[no-untyped-def]
    """float32 ``x`` rounded to the nearest F16 value (ties to even), returned as float32: what a conversion to
    F16 and back gives (F16C's ``vcvtps2ph`` with round-to-nearest, ggml's FP32_TO_FP16)."""
    b = bits(x)
    sign = b & _SIGN
    a = b & _ABS
    if a >= _INF:
        return x if a == _INF else from_bits(sign | _QNAN)
    if a >= _HALF_OVERFLOW:
        return from_bits(sign | _INF)
    if a < _HALF_NORMAL:
        # Below F16's normal range the step is 2^-24 whatever the exponent: round the scaled value to an integer
        # (exact in float64), ties to even.
        q = np.rint(np.float64(from_bits(a)) * 16777216.0)
        return from_bits(sign | bits(F32(q / 16777216.0)))
    # Keep 10 of float32's 23 fraction bits, rounding the other 13 to nearest, ties to even.
    a = (a + _LOW + ((a >> np.uint32(13)) & np.uint32(1))) & _KEEP
    return from_bits(sign | a)


@intrinsic
def half_value(typingctx, x):  # type: ignore[no-untyped-def]
    """The F16 value of a uint16 bit pattern, as float32 (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen
