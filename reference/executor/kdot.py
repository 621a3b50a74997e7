"""MUL_MAT of the K-quants (Q2_K ... Q6_K), IQ4_XS and TQ2_0 in the arithmetic of upstream's AVX2 dot products
with Q8_K activations (``ggml_vec_dot_*_q8_K``).

Per super-block of 256, the kernels sum integer products into eight int32 lanes (lane i takes elements 4i..4i+3 of
every 32, each times its sub-block's scale; Q6_K then subtracts 32 x scale x the Q8_K block sums of elements
32i..32i+31 from lane i), convert the lanes to float32 and fold them into eight float32 accumulators with a fused
multiply-add by ``y.d * fp16(x.d)``.  The mins of Q2_K go into the same accumulators first (lane i: the mins of
groups 2i and 2i+1 times their block sums, by ``-y.d * fp16(x.dmin)``), those of Q4_K through a second, four-lane
accumulator, those of Q5_K through a float32 running sum; the result is the pairwise lane sum plus that.  IQ4_XS is
Q4_K's main part with its lookup values and no mins; TQ2_0 subtracts each block sum once (its codes are q - 1) and
adds ``lanes * d`` (written as a multiply and an add, which the compiler fuses).  Integer
lanes are computed exactly in float64; each fused multiply-add is one float64 operation rounded once to float32.
"""

from __future__ import annotations

import numpy as np

from .dequant import (
    _Q3_HBIT,
    _Q3_HBYTE,
    _Q6_HBYTE,
    _Q6_HSHIFT,
    _Q6_LBYTE,
    _Q6_LSHIFT,
    _Q23_BYTE,
    _Q23_SHIFT,
    _iq4_xs_scales,
    _k_scales_6bit,
    _nibble_chunks,
    dequantize,
)
from .exact_kernels import kernels
from .formats import (
    IQ4_XS,
    IQ4NL_LEVELS,
    LAYOUT,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    SHIFT2,
    TQ1_0,
    TQ2_0,
    half_field,
    low_high,
)
from .grids import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS
from .q8dot import in_lane_order
from .quant import signed_absmax
from .simd_sums import K_CORRECTED, K_MINS_FIRST, K_MINS_FOUR, K_MINS_SUM, K_PLAIN

F = np.float32
F64 = np.float64
#: The grid types whose kernels sum (2 x scale + 1) x grid value x sign in integer lanes and scale the lane sum at
#: the end: the integer per element is the type's dequantised value with d = 1 times this factor, the final
#: multiplier its inverse (0.125f, 0.25f, 1).
GRID_FACTORS: dict[int, int] = {IQ2_XXS: 8, IQ2_XS: 8, IQ2_S: 8, IQ3_XXS: 4, IQ3_S: 1}
K_TYPES: tuple[int, ...] = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, TQ1_0, TQ2_0, *GRID_FACTORS)


def pack_weights(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Blocks ``(m, nsb, size)`` to one flat byte array: each element's code times its sub-block scale (what the
    kernel's integer lanes multiply by the activation codes; int16, in lane order), then the 16 per-16 values the
    block sums are weighted by (Q6_K: 32 x scale; Q4_K/Q5_K: the 8 mins, each twice; int32), then fp16 d and fp16
    dmin (0 for Q6_K) as float32, each a section of its own."""
    m, nsb, size = blocks.shape
    b = np.ascontiguousarray(blocks).reshape(m * nsb, size)
    f = LAYOUT[type_id]
    out = np.zeros((m * nsb, 256 + 16 + 2), dtype=F64)
    if type_id in GRID_FACTORS or type_id == TQ1_0:
        unit = b.copy()
        unit[:, f["d"]] = np.frombuffer(np.float16(1).tobytes(), np.uint8)  # d = 1: the integer part alone
        values = dequantize(type_id, unit.reshape(m, nsb, size)).reshape(-1, 256).astype(F64)
        if type_id == TQ1_0:  # the trits 0..2 the kernel multiplies (it subtracts the block sums for the - 1)
            out[:, :256] = np.rint(values) + 1
            out[:, 256:272] = 1.0
        else:
            out[:, :256] = np.rint(values * GRID_FACTORS[type_id])
    elif type_id == IQ4_XS:
        q = IQ4NL_LEVELS[low_high(np.ascontiguousarray(b[:, f["qs"]]).reshape(-1, 16))].reshape(-1, 8, 32)
        out[:, :256] = (q.astype(F64) * _iq4_xs_scales(b).astype(F64)[:, :, None]).reshape(-1, 256)
    elif type_id == TQ2_0:
        q = (b[:, f["qs"]].reshape(-1, 2, 1, 32) >> SHIFT2[None, None, :, None]) & 3
        out[:, :256] = q.reshape(-1, 256).astype(F64)
        out[:, 256:272] = 1.0
    elif type_id in (Q2_K, Q3_K):
        q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(F64)
        sc = b[:, f["scales"]]
        if type_id == Q2_K:
            out[:, :256] = q * np.repeat((sc & 0x0F).astype(F64), 16, axis=1)
            out[:, 256:272] = (sc >> 4).astype(F64)
            out[:, 273] = half_field(b, f["dmin"])[:, 0]
        else:
            k = np.arange(16)
            low = np.where(k < 8, sc[:, k % 8] & 0x0F, sc[:, k % 8] >> 4)
            high = (sc[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
            scales = (low | (high << 4)).astype(F64) - 32
            hbit = (b[:, f["hmask"]][:, _Q3_HBYTE] >> _Q3_HBIT) & 1
            out[:, :256] = (q - np.where(hbit == 0, 4.0, 0.0)) * np.repeat(scales, 16, axis=1)
    elif type_id == Q6_K:
        low = (b[:, f["ql"]][:, _Q6_LBYTE] >> _Q6_LSHIFT) & 0x0F
        high = (b[:, f["qh"]][:, _Q6_HBYTE] >> _Q6_HSHIFT) & 3
        q = (low | (high << 4)).astype(F64)
        sc = b[:, f["scales"]].view(np.int8).astype(F64)  # (n, 16), one per 16 elements
        out[:, :256] = q * np.repeat(sc, 16, axis=1)
        out[:, 256:272] = 32 * sc
        out[:, 273] = 0.0
    else:
        q = _nibble_chunks(np.ascontiguousarray(b[:, f["qs"]]))  # (n, 8, 32)
        if type_id == Q5_K:
            high = (b[:, f["qh"]][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = q | (high << 4)
        sc, mn = _k_scales_6bit(b[:, f["scales"]])
        out[:, :256] = (q.astype(F64) * sc[:, :, None]).reshape(-1, 256)
        out[:, 256:272] = np.repeat(mn.astype(F64), 2, axis=1)
        out[:, 273] = half_field(b, f["dmin"])[:, 0]
    out[:, 272] = half_field(b, f["d"])[:, 0]
    # Codes times scales lie within +-8,064 (Q6_K: 63 x -128), block-sum weights are small integers, d and dmin
    # fp16 values: int16, int32 and float32 hold them exactly (2.6 bytes a weight).
    eff = in_lane_order(out[:, :256].reshape(m, nsb * 256).astype(np.int16))
    wsum = out[:, 256:272].astype(np.int32).reshape(m, nsb * 16)
    scales = np.ascontiguousarray(out[:, 272:274].astype(F).reshape(m, nsb, 2).transpose(0, 2, 1)).reshape(m, 2 * nsb)
    # One flat byte array of three contiguous sections (rows of a section contiguous: the loops vectorise over them).
    return np.concatenate([eff.reshape(-1).view(np.uint8), wsum.reshape(-1).view(np.uint8),
                           scales.reshape(-1).view(np.uint8)])


def _unpack(packed: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The packed form's views for ``m`` rows: eff int16 ``(m, k)``, wsum int32 ``(m, nsb * 16)``, d and dmin
    float32 ``(m, nsb)``."""
    nsb = packed.size // m // (512 + 64 + 8)
    a, b = m * nsb * 512, m * nsb * 576
    eff = packed[:a].view(np.int16).reshape(m, nsb * 256)
    wsum = packed[a:b].view(np.int32).reshape(m, nsb * 16)
    scales = packed[b:].view(F).reshape(m, 2 * nsb)
    return eff, wsum, np.ascontiguousarray(scales[:, :nsb]), np.ascontiguousarray(scales[:, nsb:])


def q8k_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``(n, k)`` as ggml's ``quantize_row_q8_K_ref``: (codes int8 ``(n, k)``, d float32 ``(n, nsb)``,
    block sums int32 ``(n, nsb * 16)``)."""
    n, k = x.shape
    flat = np.ascontiguousarray(x, dtype=F).reshape(-1, 256)
    mx = signed_absmax(flat)
    iscale = np.divide(F(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.rint(flat * iscale), 127)
    d = np.divide(F(1), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(F)
    codes = q.astype(np.int8).reshape(n, k)
    return codes, d.reshape(n, k // 256), codes.reshape(n, k // 16, 16).sum(axis=2, dtype=np.int32)


#: The kernel's treatment of block sums, per type (:func:`~.compiled.k_products`).
#: Q6_K, TQ1_0 and TQ2_0 subtract block sums from the lanes (Q6_K: 32 x scale per 16; TQ1_0/TQ2_0: each once,
#: their codes being q - 1).
_MODES = {Q2_K: K_MINS_FIRST, Q4_K: K_MINS_FOUR, Q5_K: K_MINS_SUM, Q6_K: K_CORRECTED, TQ1_0: K_CORRECTED,
          TQ2_0: K_CORRECTED}


def products(type_id: int, packed: np.ndarray, x: np.ndarray, m: int) -> np.ndarray:
    """``x @ w^T`` as upstream's kernel computes it: weights as :func:`pack_weights` gives them for ``m`` rows,
    activations ``(n, k)`` float32.  Returns float32 ``(n, m)``."""
    eff, wsum, wd, wdmin = _unpack(packed, m)
    codes, yd, bsums = q8k_codes(x)
    out = np.empty((x.shape[0], eff.shape[0]), dtype=F)
    grid = type_id in GRID_FACTORS
    # *s = 0.125f * hsum for the grid types: a float32 multiply by the factor's inverse.
    scale = F(1 / GRID_FACTORS[type_id]) if grid else F(1)
    mode = _MODES.get(type_id, K_PLAIN)
    kernels().k_products(eff, wsum, wd, wdmin, in_lane_order(codes), yd, bsums, mode, grid, scale, out)
    return out
