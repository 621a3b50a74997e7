"""Compute: one small graph per op family, the server's outputs compared with the kit's reference executor.

Inputs are uploaded with SET_TENSOR and mirrored locally; the same GRAPH_COMPUTE tensors are rebuilt and run by
:mod:`ggml_rpc.reference.executor` on the mirror; outputs are compared by normalised mean squared error (the
measure llama.cpp's backend tests use).  A server that closes the connection on a graph declines the op: the
check reports "unsupported", not a failure.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.conformance.checks._support import GraphBuilder, fail
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.client import ConnectionClosed
from ggml_rpc.conformance.harness import Category, Context
from ggml_rpc.spec import (
    TYPES,
    Command,
    GgmlOp,
    GgmlType,
    GluOp,
    UnaryOp,
)

CO = Category.COMPUTE
F32, F16, I32, Q8_0 = int(GgmlType.F32), int(GgmlType.F16), int(GgmlType.I32), int(GgmlType.Q8_0)

#: NMSE limits.  llama.cpp's backend tests use 1e-7 by default, 5e-4 for MUL_MAT and 1e-4 for ROPE; transcendental
#: functions, norms and soft_max get 1e-5 here because ggml's CPU kernels use approximations (an f16 GELU table,
#: vectorised exp) that a numpy reference does not reproduce bit for bit.
NMSE_EXACT = 1e-7
NMSE_MATH = 1e-5
NMSE_MATMUL = 5e-4
#: llama.cpp's backend tests allow ROPE 1e-4 (angles are float32 recurrences).
NMSE_ROPE = 1e-4


def op_params(*values: float | int) -> list[int]:
    """op_params as 16 raw i32: ints as they are, floats as their f32 bit pattern."""
    out = []
    for v in values:
        if isinstance(v, float):
            out.append(int(np.array([v], dtype=np.float32).view(np.int32)[0]))
        else:
            out.append(int(v))
    return out


@_check("COMPUTE-001", "binary ops ADD, SUB, MUL, DIV (with row broadcast) match the reference", CO,
        section=Command.GRAPH_COMPUTE)
def binary(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    a = g.input(F32, (16, 4), r.standard_normal((4, 16)))
    b = g.input(F32, (16, 4), r.standard_normal((4, 16)))
    row = g.input(F32, (16, 1), r.uniform(0.5, 2.0, (1, 16)))
    outs = [g.op(GgmlOp.ADD, [a, b], (16, 4)), g.op(GgmlOp.SUB, [a, b], (16, 4)),
            g.op(GgmlOp.MUL, [a, row], (16, 4)), g.op(GgmlOp.DIV, [a, row], (16, 4))]
    return g.compare(outs, NMSE_EXACT, "binary ops")


@_check("COMPUTE-002", "unary math (SQR, SQRT, SIN, COS, SCALE) matches the reference", CO,
        section=Command.GRAPH_COMPUTE)
def math(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (32, 2), r.uniform(0.1, 3.0, (2, 32)))
    outs = [g.op(GgmlOp.SQR, [x], (32, 2)), g.op(GgmlOp.SQRT, [x], (32, 2)), g.op(GgmlOp.SIN, [x], (32, 2)),
            g.op(GgmlOp.COS, [x], (32, 2)), g.op(GgmlOp.SCALE, [x], (32, 2), params=op_params(0.75, 0.0))]
    return g.compare(outs, NMSE_MATH, "math ops")


@_check("COMPUTE-003", "UNARY activations (NEG, RELU, GELU, SILU, TANH, SIGMOID, EXP) match the reference", CO,
        section=Command.GRAPH_COMPUTE)
def unary(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (32, 2), r.standard_normal((2, 32)))
    outs = [g.op(GgmlOp.UNARY, [x], (32, 2), params=[int(u)])
            for u in (UnaryOp.NEG, UnaryOp.RELU, UnaryOp.GELU, UnaryOp.SILU, UnaryOp.TANH, UnaryOp.SIGMOID,
                      UnaryOp.EXP)]
    return g.compare(outs, NMSE_MATH, "unary ops")


@_check("COMPUTE-004", "MUL_MAT (f32 x f32 and f16 x f32) matches the reference", CO, section=Command.GRAPH_COMPUTE)
def mul_mat(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    w = g.input(F32, (32, 8), r.standard_normal((8, 32)))
    wh = g.input(F16, (32, 8), r.standard_normal((8, 32)))
    x = g.input(F32, (32, 3), r.standard_normal((3, 32)))
    outs = [g.op(GgmlOp.MUL_MAT, [w, x], (8, 3)), g.op(GgmlOp.MUL_MAT, [wh, x], (8, 3))]
    return g.compare(outs, NMSE_MATMUL, "matrix multiplication")


@_check("COMPUTE-005", "RMS_NORM and NORM match the reference", CO, section=Command.GRAPH_COMPUTE)
def norms(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (64, 3), r.standard_normal((3, 64)) * 3 + 1)
    outs = [g.op(GgmlOp.RMS_NORM, [x], (64, 3), params=op_params(1e-6)),
            g.op(GgmlOp.NORM, [x], (64, 3), params=op_params(1e-5))]
    return g.compare(outs, NMSE_MATH, "normalisation")


@_check("COMPUTE-006", "SOFT_MAX (with scale) matches the reference", CO, section=Command.GRAPH_COMPUTE)
def soft_max(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (32, 4), r.standard_normal((4, 32)) * 4)
    outs = [g.op(GgmlOp.SOFT_MAX, [x], (32, 4), params=op_params(0.5, 0.0))]
    return g.compare(outs, NMSE_MATH, "soft_max")


@_check("COMPUTE-007", "ROPE (normal and NeoX modes) matches the reference", CO, section=Command.GRAPH_COMPUTE)
def rope(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (16, 2, 3), r.standard_normal((3, 2, 16)))
    pos = g.input(I32, (3,), np.array([0, 5, 17]))
    outs = []
    for mode in (0, 2):
        params = op_params(0, 16, mode, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        outs.append(g.op(GgmlOp.ROPE, [x, pos], (16, 2, 3), params=params))
    return g.compare(outs, NMSE_ROPE, "rope")


@_check("COMPUTE-008", "GET_ROWS gathers the indexed rows", CO, section=Command.GRAPH_COMPUTE)
def get_rows(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    table = g.input(F32, (8, 6), r.standard_normal((6, 8)))
    idx = g.input(I32, (3,), np.array([4, 0, 5]))
    outs = [g.op(GgmlOp.GET_ROWS, [table, idx], (8, 3))]
    return g.compare(outs, NMSE_EXACT, "get_rows")


@_check("COMPUTE-009", "layout: CONT of a TRANSPOSE view, and CPY f32 -> f16", CO, section=Command.GRAPH_COMPUTE)
def layout(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    a = g.input(F32, (8, 4), r.standard_normal((4, 8)))
    at = g.view(GgmlOp.TRANSPOSE, a, (4, 8), (a["nb"][1], a["nb"][0], a["nb"][2], a["nb"][3]))
    cont = g.op(GgmlOp.CONT, [at], (4, 8))
    half = g.cpy(a, F16)
    return g.compare([cont, half], NMSE_MATH, "layout ops")


@_check("COMPUTE-010", "GRAPH_RECOMPUTE re-runs the stored graph on the tensors' current data", CO,
        section=Command.GRAPH_RECOMPUTE)
def recompute(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    a = g.input(F32, (16,), r.standard_normal(16))
    b = g.input(F32, (16,), r.standard_normal(16))
    out = g.op(GgmlOp.ADD, [a, b], (16,))
    first = g.compare([out], NMSE_EXACT, "first GRAPH_COMPUTE")
    new_a = r.standard_normal(16).astype(np.float32)
    g.client.set_tensor(a, 0, new_a.tobytes())
    off = a["data"] - g.buf.base
    g.mirror.memory[off : off + 64] = np.frombuffer(new_a.tobytes(), dtype=np.uint8)
    try:
        g.client.graph_recompute(0)
        got = bytes(g.client.get_tensor(out, 0, 64))
    except ConnectionClosed:
        raise fail("the server closed the connection on GRAPH_RECOMPUTE after a successful GRAPH_COMPUTE",
                   expected="the stored graph re-run", got="connection closed") from None
    return g._judge([out], [got], NMSE_EXACT, "GRAPH_RECOMPUTE with new input data") + f"; {first}"


@_check("COMPUTE-011", "GLU (fused SWIGLU, split GEGLU) matches the reference", CO, section=Command.GRAPH_COMPUTE)
def glu(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (32, 2), r.standard_normal((2, 32)))
    a = g.input(F32, (16, 2), r.standard_normal((2, 16)))
    b = g.input(F32, (16, 2), r.standard_normal((2, 16)))
    outs = [g.op(GgmlOp.GLU, [x], (16, 2), params=[int(GluOp.SWIGLU), 0]),
            g.op(GgmlOp.GLU, [a, b], (16, 2), params=[int(GluOp.GEGLU), 0])]
    return g.compare(outs, NMSE_MATH, "glu")


@_check("COMPUTE-012", "reductions SUM_ROWS, MEAN and SUM match the reference", CO, section=Command.GRAPH_COMPUTE)
def reductions(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (16, 3), r.standard_normal((3, 16)))
    outs = [g.op(GgmlOp.SUM_ROWS, [x], (1, 3)), g.op(GgmlOp.MEAN, [x], (1, 3)), g.op(GgmlOp.SUM, [x], (1,))]
    return g.compare(outs, NMSE_MATH, "reductions")


@_check("COMPUTE-013", "REPEAT and CONCAT match the reference", CO, section=Command.GRAPH_COMPUTE)
def repeat_concat(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    small = g.input(F32, (4, 1), r.standard_normal((1, 4)))
    a = g.input(F32, (4, 2), r.standard_normal((2, 4)))
    b = g.input(F32, (4, 3), r.standard_normal((3, 4)))
    outs = [g.op(GgmlOp.REPEAT, [small], (4, 3)), g.op(GgmlOp.CONCAT, [a, b], (4, 5), params=[1])]
    return g.compare(outs, NMSE_EXACT, "repeat/concat")


def quantize_q8_0(x: np.ndarray) -> bytes:
    """Q8_0 blocks of a float array whose rows are multiples of 32: per block an f16 scale and 32 int8."""
    blocks = x.astype(np.float32).reshape(-1, TYPES[Q8_0].blck)
    d = np.abs(blocks).max(axis=1) / 127.0
    safe = np.where(d == 0, 1.0, d)
    q = np.clip(np.rint(blocks / safe[:, None]), -127, 127).astype(np.int8)
    out = np.zeros(len(blocks), dtype=[("d", "<f2"), ("q", "i1", (32,))])
    out["d"], out["q"] = d.astype(np.float16), q
    return out.tobytes()


@_check("COMPUTE-014", "MUL_MAT with Q8_0 weights matches the reference", CO, section=Command.GRAPH_COMPUTE)
def mul_mat_q8_0(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    w = g.input(Q8_0, (64, 8), quantize_q8_0(r.standard_normal((8, 64))))
    x = g.input(F32, (64, 3), r.standard_normal((3, 64)))
    outs = [g.op(GgmlOp.MUL_MAT, [w, x], (8, 3))]
    return g.compare(outs, NMSE_MATMUL, "quantised matrix multiplication")


@_check("COMPUTE-015", "SOFT_MAX with a causal mask matches the reference", CO, section=Command.GRAPH_COMPUTE)
def soft_max_mask(ctx: Context) -> str:
    g, r = GraphBuilder(ctx), ctx.rng()
    x = g.input(F32, (8, 4), r.standard_normal((4, 8)))
    mask = np.where(np.arange(8)[None, :] > np.arange(4)[:, None] + 4, -np.inf, 0.0)
    m = g.input(F32, (8, 4), mask)
    outs = [g.op(GgmlOp.SOFT_MAX, [x, m], (8, 4), params=op_params(1.0, 0.0))]
    return g.compare(outs, NMSE_MATH, "masked soft_max")
