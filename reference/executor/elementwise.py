"""Element-wise ops: the binary arithmetic ops with ggml's repeat-broadcast, SCALE, the math ops, every UNARY and
GLU sub-op, CLAMP, LEAKY_RELU, FILL and ADD_ID.

Values are computed in float32 and converted to the result's type on the way out, as ggml's CPU backend does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from ggml_rpc.spec import GgmlOp, GluOp, UnaryOp

from ..graph import GraphTensor
from .core import (
    FLOATS,
    READABLE,
    WRITABLE,
    can_repeat,
    declare,
    kernel,
    need_types,
    params_f32,
    params_i32,
    prepared,
    read,
    read_index,
    same_shape,
    src,
    tile_to,
    write,
)
from .gelu import gelu, gelu_brain, gelu_half, gelu_quick, gelu_quick_brain
from .memory import BF16, F16, F32, Memory, node_error
from .simd_math import silu_libm, silu_rows
from .types import round_away

_INV_SQRT2 = np.float32(0.7071067811865476)


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7: below float32 resolution of GELU's output)."""
    x64 = np.asarray(x, dtype=np.float64)
    s = np.sign(x64)
    a = np.abs(x64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + erf(x * _INV_SQRT2))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def _xielu(x: np.ndarray, node: GraphTensor) -> np.ndarray:
    p = params_f32(node)
    alpha_n, alpha_p, beta, eps = p[1], p[2], p[3], p[4]
    pos = alpha_p * x * x + beta * x
    neg = (np.expm1(np.minimum(x, eps)) - x) * alpha_n + beta * x
    return np.where(x > 0, pos, neg)


_UNARY: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    UnaryOp.ABS: np.abs,
    UnaryOp.SGN: np.sign,
    UnaryOp.NEG: np.negative,
    UnaryOp.STEP: lambda x: (x > 0).astype(np.float32),
    UnaryOp.TANH: np.tanh,
    UnaryOp.ELU: lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))),
    UnaryOp.RELU: lambda x: np.maximum(x, np.float32(0)),
    UnaryOp.SIGMOID: _sigmoid,
    UnaryOp.GELU: gelu,
    UnaryOp.GELU_QUICK: gelu_quick,
    UnaryOp.SILU: silu,
    UnaryOp.HARDSWISH: lambda x: x * np.clip((x + np.float32(3)) / np.float32(6), 0, 1),
    UnaryOp.HARDSIGMOID: lambda x: np.clip((x + np.float32(3)) / np.float32(6), 0, 1),
    UnaryOp.EXP: np.exp,
    UnaryOp.EXPM1: np.expm1,
    UnaryOp.SOFTPLUS: lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))),
    UnaryOp.GELU_ERF: gelu_erf,
    UnaryOp.FLOOR: np.floor,
    UnaryOp.CEIL: np.ceil,
    UnaryOp.ROUND: round_away,
    UnaryOp.TRUNC: np.trunc,
}

for _u in UnaryOp:
    declare(f"UNARY/{_u.name}", src=FLOATS, dst=FLOATS)


# ---- binary arithmetic ---------------------------------------------------------------------------------------------


def _binary(node: GraphTensor, mem: Memory, ufunc: np.ufunc) -> None:
    a_t, b_t = node.src[0], node.src[1]
    if a_t is not None and b_t is not None and node.type == F32 and a_t.type == F32 and b_t.type == F32:
        # The hot path (per-node overhead matters for long graphs): same-shape F32, the ufunc writes straight
        # into the node's memory.
        out = mem.raw(node)
        a = mem.raw(a_t)
        b = mem.raw(b_t)
        if out.shape == a.shape == b.shape:
            ufunc(a, b, out=out)
            return
    a_t, b_t = src(node, 0), src(node, 1)
    need_types(node, a_t, READABLE, "source 0")
    need_types(node, b_t, READABLE, "source 1")
    same_shape(node, a_t)
    if not can_repeat(b_t, a_t):
        raise node_error(node, "source 1 cannot be repeated to the shape of source 0")
    if node.type == F32 and a_t.type == F32 and b_t.type == F32:
        a = mem.raw(a_t)
        ufunc(a, tile_to(mem.raw(b_t), a.shape), out=mem.raw(node))
        return
    a = read(mem, a_t)
    write(mem, node, ufunc(a, tile_to(read(mem, b_t), a.shape)))


def _prepare_binary(node: GraphTensor, mem: Memory, ufunc: np.ufunc) -> tuple[np.ufunc, tuple] | None:
    """All-F32 with source 1 equal to source 0's shape or broadcast to it as a view: one ufunc call, as
    ``_binary`` makes it (any other case, refusals included, is left to ``_binary``)."""
    a_t, b_t = node.src[0], node.src[1]
    if a_t is None or b_t is None or not node.type == a_t.type == b_t.type == F32:
        return None
    out, a, b = mem.raw(node), mem.raw(a_t), mem.raw(b_t)
    if out.shape != a.shape:
        return None
    if b.shape != a.shape:
        if not can_repeat(b_t, a_t) or not all(v in (1, s) for v, s in zip(b.shape, a.shape, strict=True)):
            return None
        b = np.broadcast_to(b, a.shape)
    return ufunc, (a, b, out)


def _register_binary(op: GgmlOp, ufunc: np.ufunc) -> None:
    kernel(op, src=READABLE, dst=WRITABLE)(lambda node, mem: _binary(node, mem, ufunc))
    prepared(op)(partial(_prepare_binary, ufunc=ufunc))


_register_binary(GgmlOp.ADD, np.add)
_register_binary(GgmlOp.SUB, np.subtract)
_register_binary(GgmlOp.MUL, np.multiply)
_register_binary(GgmlOp.DIV, np.divide)


@kernel(GgmlOp.ADD1, src=READABLE, dst=WRITABLE)
def _add1(node: GraphTensor, mem: Memory) -> None:
    a_t, b_t = src(node, 0), src(node, 1)
    same_shape(node, a_t)
    if b_t.ne[0] * b_t.ne[1] * b_t.ne[2] * b_t.ne[3] != 1:
        raise node_error(node, "source 1 must be a scalar")
    write(mem, node, read(mem, a_t) + read(mem, b_t).reshape(()))


@kernel(GgmlOp.ADD_ID, src=FLOATS, dst=(F32,))
def _add_id(node: GraphTensor, mem: Memory) -> None:
    # dst[:, i1, i2] = a[:, i1, i2] + b[:, ids[i1, i2]]
    a_t, b_t, ids_t = src(node, 0), src(node, 1), src(node, 2)
    same_shape(node, a_t)
    if b_t.ne[0] != a_t.ne[0] or tuple(ids_t.ne[:2]) != tuple(a_t.ne[1:3]) or a_t.ne[3] != 1:
        raise node_error(node, "shapes do not fit ADD_ID (a [n, e, t], b [n, experts], ids [e, t])")
    ids = read_index(mem, node, ids_t, int(b_t.ne[1]), "expert id")[0, 0]  # (t, e)
    b = read(mem, b_t)[0, 0]  # (experts, n)
    a = read(mem, a_t)[0]  # (t, e, n)
    write(mem, node, (a + b[ids])[None])


@kernel(GgmlOp.SCALE, src=FLOATS, dst=FLOATS)
def _scale(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    same_shape(node, a_t)
    p = params_f32(node)
    s, b = p[0], p[1]
    x = read(mem, a_t)
    write(mem, node, x * s + b if b != 0 else x * s)


def _math(op: GgmlOp, fn: Callable[[np.ndarray], np.ndarray]) -> None:
    def run(node: GraphTensor, mem: Memory) -> None:
        a_t = src(node, 0)
        need_types(node, a_t, READABLE, "source 0")
        same_shape(node, a_t)
        write(mem, node, fn(read(mem, a_t)))

    kernel(op, src=FLOATS, dst=FLOATS)(run)


_math(GgmlOp.SQR, np.square)
_math(GgmlOp.SQRT, np.sqrt)
_math(GgmlOp.LOG, np.log)
_math(GgmlOp.SIN, np.sin)
_math(GgmlOp.COS, np.cos)


@kernel(GgmlOp.CLAMP, src=FLOATS, dst=FLOATS)
def _clamp(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    same_shape(node, a_t)
    p = params_f32(node)
    write(mem, node, np.minimum(np.maximum(read(mem, a_t), p[0]), p[1]))


@kernel(GgmlOp.LEAKY_RELU, src=FLOATS, dst=FLOATS)
def _leaky_relu(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    same_shape(node, a_t)
    slope = params_f32(node)[0]
    x = read(mem, a_t)
    write(mem, node, np.maximum(x, 0) + slope * np.minimum(x, 0))


@kernel(GgmlOp.FILL, src=(), dst=FLOATS)
def _fill(node: GraphTensor, mem: Memory) -> None:
    write(mem, node, params_f32(node)[0])


@kernel(GgmlOp.UNARY, src=FLOATS, dst=FLOATS, note="see the UNARY/ rows")
def _unary(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    same_shape(node, a_t)
    sub = int(params_i32(node)[0])
    if sub == UnaryOp.XIELU:
        write(mem, node, _xielu(read(mem, a_t), node))
        return
    if sub == UnaryOp.SILU and a_t.type == F32 and node.type == F32:
        write(mem, node, silu_rows(read(mem, a_t)))  # ggml_vec_silu_f32's order, row by row
        return
    if sub == UnaryOp.SILU and a_t.type != F32:
        write(mem, node, silu_libm(read(mem, a_t)))  # F16/BF16: the scalar form, value by value
        return
    fn = _UNARY.get(sub)
    if fn is None:
        raise node_error(node, f"UNARY sub-op {sub} is not supported")
    fn = _BY_TYPE.get((a_t.type, sub), fn)
    if node.type == F32 and a_t.type == F32 and isinstance(fn, np.ufunc):
        fn(mem.raw(a_t), out=mem.raw(node))
        return
    write(mem, node, fn(read(mem, a_t)))


@prepared(GgmlOp.UNARY)
def _prepare_unary(node: GraphTensor, mem: Memory) -> tuple[np.ufunc, tuple] | None:
    """An F32 -> F32 sub-op that is a numpy ufunc: one call, as ``_unary`` makes it."""
    a_t = node.src[0]
    if a_t is None or node.type != F32 or a_t.type != F32 or tuple(a_t.ne) != tuple(node.ne):
        return None
    fn = _UNARY.get(int(params_i32(node)[0]))
    if not isinstance(fn, np.ufunc):
        return None
    return fn, (mem.raw(a_t), mem.raw(node))


# ---- GLU ---------------------------------------------------------------------------------------------------------


def _swiglu_oai(a: np.ndarray, b: np.ndarray, node: GraphTensor) -> np.ndarray:
    p = params_f32(node)
    alpha, limit = p[2], p[3]
    x = np.minimum(a, limit)
    y = np.clip(b, -limit, limit)
    return x / (np.float32(1) + np.exp(alpha * -x)) * (y + np.float32(1))


def _swiglu_clamp(a: np.ndarray, b: np.ndarray, node: GraphTensor) -> np.ndarray:
    # SwiGLU with the gate clamped from above and the linear half into [-limit, limit] (limit: float op_params[3]).
    limit = params_f32(node)[3]
    return silu(np.minimum(a, limit)) * np.clip(b, -limit, limit)


#: GELU of other source types as ggml computes them: F16 straight from the table (no clamp at +-10), BF16 by the
#: formula value by value (ggml_vec_gelu_f16 / _bf16, ggml_vec_geglu_f16 / _bf16, and the quick forms).
_BY_TYPE: dict[tuple[int, int], Callable[[np.ndarray], np.ndarray]] = {
    (F16, UnaryOp.GELU): gelu_half, (F16, UnaryOp.GELU_QUICK): gelu_quick,
    (BF16, UnaryOp.GELU): gelu_brain, (BF16, UnaryOp.GELU_QUICK): gelu_quick_brain}
_BY_TYPE_GLU: dict[tuple[int, int], Callable[[np.ndarray], np.ndarray]] = {
    (F16, GluOp.GEGLU): gelu_half, (F16, GluOp.GEGLU_QUICK): gelu_quick,
    (BF16, GluOp.GEGLU): gelu_brain, (BF16, GluOp.GEGLU_QUICK): gelu_quick_brain}

_GLU: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GluOp.REGLU: lambda x: np.maximum(x, np.float32(0)),
    GluOp.GEGLU: gelu,
    GluOp.SWIGLU: silu,
    GluOp.GEGLU_ERF: gelu_erf,
    GluOp.GEGLU_QUICK: gelu_quick,
}

for _g in GluOp:
    declare(f"GLU/{_g.name}", src=FLOATS, dst=FLOATS)


@kernel(GgmlOp.GLU, src=FLOATS, dst=FLOATS, note="see the GLU/ rows")
def _glu(node: GraphTensor, mem: Memory) -> None:
    a_t = src(node, 0)
    need_types(node, a_t, FLOATS, "source 0")
    p = params_i32(node)
    sub, swapped = int(p[0]), int(p[1])
    b_t = node.src[1]
    nc = int(node.ne[0])
    if b_t is None:
        # ggml halves the width with a floor: an odd source's last column belongs to neither half.
        if tuple(a_t.ne[1:]) != tuple(node.ne[1:]) or a_t.ne[0] // 2 != nc:
            raise node_error(node, "fused GLU needs source 0 of twice the result's width (rounded down)")
        x = read(mem, a_t)
        lo, hi = x[..., :nc], x[..., nc : 2 * nc]
        a, b = (hi, lo) if swapped else (lo, hi)
    else:
        need_types(node, b_t, FLOATS, "source 1")
        same_shape(node, a_t)
        same_shape(node, b_t, "source 1")
        a, b = read(mem, a_t), read(mem, b_t)
    if sub == GluOp.SWIGLU_OAI:
        write(mem, node, _swiglu_oai(a, b, node))
        return
    if sub == GluOp.SWIGLU_CLAMP:
        write(mem, node, _swiglu_clamp(a, b, node))
        return
    fn = _GLU.get(sub)
    if fn is None:
        raise node_error(node, f"GLU sub-op {sub} is not supported")
    if sub == GluOp.SWIGLU and a_t.type == F32 and node.type == F32 and (b_t is None or b_t.type == F32):
        fn = silu_rows  # ggml_vec_swiglu_f32's own order (its vector exp, then libm for the row's tail)
    elif sub == GluOp.SWIGLU:
        fn = silu_libm  # F16/BF16: the scalar form with the C library's expf, value by value
    else:
        fn = _BY_TYPE_GLU.get((a_t.type, sub), fn)
    write(mem, node, fn(a) * b)
