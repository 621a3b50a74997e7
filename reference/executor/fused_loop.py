"""The compiled loop of :mod:`.fused` (numba): a table of float32 binary nodes, computed in order.

Compiled without fast-math and with numpy's error model (a division by zero gives an infinity or a NaN, as numpy's
does, instead of raising), so every value is the IEEE float32 operation numpy's ufunc computes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def _f32_at(typingctx, address):  # type: ignore[no-untyped-def]
    # A float32 pointer from an address the plan took from one of its own views.
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return sig, codegen


@njit(cache=True, nogil=True, error_model="numpy")
def run_binary(table: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each row (op, source 0, source 1, result, size, source 1 row length): result = source 0 op source 1, op 0-3
    add, subtract, multiply, divide; source 1 repeated every ``row length`` values."""
    for s in range(table.shape[0]):
        op, n, nb = table[s, 0], table[s, 4], table[s, 5]
        a = carray(_f32_at(table[s, 1]), n)
        b = carray(_f32_at(table[s, 2]), nb)
        out = carray(_f32_at(table[s, 3]), n)
        for base in range(0, n, nb):
            if op == 0:
                for j in range(nb):
                    out[base + j] = a[base + j] + b[j]
            elif op == 1:
                for j in range(nb):
                    out[base + j] = a[base + j] - b[j]
            elif op == 2:
                for j in range(nb):
                    out[base + j] = a[base + j] * b[j]
            else:
                for j in range(nb):
                    out[base + j] = a[base + j] / b[j]
