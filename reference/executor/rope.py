"""ROPE: rotary position embedding, normal, NeoX, multi-section (plain and interleaved) and vision modes, with
frequency factors and YaRN parameters from op_params.  Angles follow ggml's float32 recurrence (theta multiplied by
the per-pair scale step by step), so results match its rounding closely.  The per-element work (the angles' cos
and sin, the rotation) is compiled in :mod:`.rope_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_f32, params_i32, prepared, read, same_shape, src, write
from .libm import logf, powf
from .memory import F32, I32, Memory, node_error
from .simd_sums import fma32

MODE_NEOX = 2
MODE_MROPE = 8
MODE_VISION = 24
MODE_IMROPE = 40


F = np.float32


def _cmax(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """C's ``MAX(a, b)`` macro, ``a > b ? a : b``: a NaN ``b`` comes through, as in ggml."""
    return np.where(np.asarray(a) > np.asarray(b), a, b).astype(F)


def _cmin(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    return np.where(np.asarray(a) < np.asarray(b), a, b).astype(F)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[np.float32, np.float32]:
    """YaRN's correction range in float32, as ggml computes it: an n_ctx_orig of 0 gives -inf (a range starting
    at 0 and ending below it), never an error."""
    with np.errstate(divide="ignore", invalid="ignore"):
        def corr_dim(n_rot: float) -> np.float32:
            ratio = F(n_ctx_orig) / (F(n_rot) * F(2) * F(math.pi))
            return F(F(F(n_dims) * logf(ratio)) / F(F(2) * logf(F(base))))

        start = np.floor(corr_dim(beta_fast))
        end = np.ceil(corr_dim(beta_slow))
    return _cmax(F(0), start)[()], _cmin(F(n_dims - 1), end)[()]


def _thetas(node: GraphTensor, pos: np.ndarray, ne0: int, mode: int, theta_scale: np.float32) -> np.ndarray:
    """The unscaled angle of every pair (n_pos, ne0 / 2): the position times theta_scale once per pair, by
    ggml's float32 recurrence (one stream per position kind for multi-section modes; vision restarts each
    stream at its section's first pair)."""
    half = ne0 // 2
    if not mode & MODE_MROPE:
        # The recurrence as one running product along the pairs: accumulate multiplies in order, so every angle is
        # rounded exactly as the step-by-step float32 loop rounds it.
        out = np.empty((pos.shape[0], half), dtype=F)
        if half:
            out[:, 0] = pos
            out[:, 1:] = theta_scale
            np.multiply.accumulate(out, axis=1, out=out)
        return out
    s = [int(x) for x in params_i32(node)[11:15]]
    sect_dims = sum(s)
    if sect_dims <= 0 or sect_dims > ne0 or pos.shape[0] != 4 or not (s[0] > 0 or s[1] > 0 or s[2] > 0):
        raise node_error(node, "multi-section rope needs 4 position rows and sections summing to 1..ne0")
    base = pos.astype(F)  # (4, n_pos): t, h, w, e
    sec_w, sec_e = s[0] + s[1], s[0] + s[1] + s[2]
    streams = base.copy()
    out = np.empty((pos.shape[1], half), dtype=F)
    for i in range(half):
        sector = i % sect_dims
        if mode == MODE_VISION:
            # The first matching restart only, as ggml's else-if chain does.
            for k, at in enumerate((0, s[0], sec_w, sec_e)):
                if sector == at:
                    streams[k] = base[k]
                    break
        if mode == MODE_IMROPE:
            if sector % 3 == 1 and sector < 3 * s[1]:
                k = 1
            elif sector % 3 == 2 and sector < 3 * s[2]:
                k = 2
            elif sector % 3 == 0 and sector < 3 * s[0]:
                k = 0
            else:
                k = 3
        else:
            k = 0 if sector < s[0] else 1 if sector < sec_w else 2 if sector < sec_e else 3
        out[:, i] = streams[k]
        streams = streams * theta_scale
    return out


def _angle_constants(node: GraphTensor, n_dims: int) -> tuple[np.float32, ...]:
    """(theta_scale, freq_scale, ext_factor, low, high, mscale): what the angles take from op_params, in float32
    as ggml computes them (YaRN's range and magnitude scale only with an ext_factor)."""
    p = params_f32(node)
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = (F(x) for x in p[5:11])
    theta_scale = powf(freq_base, F(-2.0) / F(n_dims))  # the C library's powf, as ggml calls it
    n_ctx_orig = int(params_i32(node)[4])
    low = high = F(0)
    mscale = attn_factor
    if ext_factor != 0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, float(freq_base), float(beta_fast), float(beta_slow))
        with np.errstate(divide="ignore"):
            # 1 + 0.1 * logf(1 / freq_scale), the product fused into the sum by upstream's compiler.
            mscale = F(mscale * fma32(F(0.1), logf(F(F(1) / freq_scale)), F(1)))
    return theta_scale, freq_scale, ext_factor, low, high, mscale


def _rope_plan(node: GraphTensor, mem: Memory, sin_sign: float) -> Callable[[], None]:
    """Every check and constant of a ROPE node, done once; returns the run, which reads the positions (and the
    frequency factors) anew each time: the kernel calls it at once, a prepared graph keeps it (the checks and
    op_params took most of a decoding step's 13 us ROPE)."""
    a_t, pos_t = src(node, 0), src(node, 1)
    need_types(node, a_t, FLOATS, "source 0")
    same_shape(node, a_t)
    if pos_t.type != I32:
        raise node_error(node, "positions must be I32")
    ip = params_i32(node)
    n_dims, mode = int(ip[1]), int(ip[2])
    ne0, ne2 = int(a_t.ne[0]), int(a_t.ne[2])
    if n_dims <= 0 or n_dims % 2 or n_dims > ne0 or ne0 % 2:
        raise node_error(node, f"rotated dims {n_dims} must be even and at most ne0 {ne0}")
    is_mrope = bool(mode & MODE_MROPE)
    if mode not in (0, MODE_NEOX, MODE_MROPE, MODE_VISION, MODE_IMROPE):
        raise node_error(node, f"rope mode {mode} is not supported")
    if mode == MODE_VISION and n_dims != ne0 // 2:
        raise node_error(node, "vision rope rotates exactly half the dims")
    # op_params[15]: the first rotated dim (ggml_rope_set_offset); dims outside [off, off + n_dims) pass through.
    off = int(ip[15]) if len(ip) > 15 else 0
    if off < 0 or off + n_dims > ne0 or (off and mode == MODE_VISION):
        raise node_error(node, f"rotation offset {off} with {n_dims} rotated dims does not fit ne0 {ne0}")
    n_pos = ne2 * (4 if is_mrope else 1)
    if pos_t.ne[0] < n_pos:
        raise node_error(node, f"positions tensor holds {int(pos_t.ne[0])} values, {n_pos} needed")
    ff_t = node.src[2]
    if ff_t is not None and (ff_t.type != F32 or ff_t.ne[0] < n_dims // 2):
        raise node_error(node, "frequency factors must be F32 with at least n_dims / 2 values")
    from .rope_steps import PAIRS_ADJACENT, PAIRS_HALVES, PAIRS_VISION, cos_sin, rotate

    theta_scale, freq_scale, ext_factor, low, high, mscale = _angle_constants(node, n_dims)
    pairs = PAIRS_ADJACENT if mode == 0 else PAIRS_VISION if mode == MODE_VISION else PAIRS_HALVES
    positions = mem.raw(pos_t).reshape(-1)[:n_pos]
    source = mem.raw(a_t) if a_t.type == F32 else None  # F32 is read in place; F16 converted each run
    dest = mem.raw(node) if node.type == F32 else None
    if dest is not None and source is not None and np.may_share_memory(source, dest):
        dest = None  # written over its source: through a temporary, as the values it reads are its own

    def run() -> None:
        pos = positions.astype(np.int64)  # any position is valid: no range to check
        if is_mrope:
            pos = pos.reshape(4, ne2)
        ff = None
        if ff_t is not None:
            # ggml reads a factor for every pair of the row (vision rotates them all); pairs past the tensor's end
            # are never rotated in the other modes.
            ff = read(mem, ff_t).reshape(-1)[: ne0 // 2].astype(np.float32)
            ff = np.concatenate((ff, np.ones(ne0 // 2 - ff.size, dtype=np.float32)))
        theta = _thetas(node, pos, ne0, mode, theta_scale)  # (ne2, ne0/2)
        cos, sin = np.empty_like(theta), np.empty_like(theta)
        cos_sin(theta, ff if ff is not None else theta[:0, 0], ff is not None, freq_scale, ext_factor, low, high,
                mscale, sin_sign, cos, sin)
        full = source if source is not None else read(mem, a_t)  # (ne3, ne2, ne1, ne0)
        if dest is not None:
            rotate(full, dest, cos, sin, n_dims, off, pairs)
            return
        out = np.empty(full.shape, dtype=np.float32)
        rotate(full, out, cos, sin, n_dims, off, pairs)
        write(mem, node, out)

    return run


kernel(GgmlOp.ROPE, src=FLOATS, dst=FLOATS, note="normal, NeoX, M-RoPE, iM-RoPE, vision; YaRN")(
    lambda node, mem: _rope_plan(node, mem, 1.0)())
kernel(GgmlOp.ROPE_BACK, src=FLOATS, dst=FLOATS, note="ROPE's inverse rotation (sin negated)")(
    lambda node, mem: _rope_plan(node, mem, -1.0)())
prepared(GgmlOp.ROPE)(lambda node, mem: (_rope_plan(node, mem, 1.0), ()))
prepared(GgmlOp.ROPE_BACK)(lambda node, mem: (_rope_plan(node, mem, -1.0), ()))
