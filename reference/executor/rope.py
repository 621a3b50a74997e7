"""ROPE: rotary position embedding, normal, NeoX, multi-section (plain and interleaved) and vision modes, with
frequency factors and YaRN parameters from op_params.  Angles follow ggml's float32 recurrence (theta multiplied by
the per-pair scale step by step), so results match its rounding closely.
"""

from __future__ import annotations

import math

import numpy as np
from ggml_rpc.spec import GgmlOp

from ..graph import GraphTensor
from .core import FLOATS, kernel, need_types, params_f32, params_i32, read, same_shape, src, write
from .memory import F32, I32, Memory, node_error

MODE_NEOX = 2
MODE_MROPE = 8
MODE_VISION = 24
MODE_IMROPE = 40


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)


def _angles(node: GraphTensor, pos: np.ndarray, ne0: int, n_dims: int, mode: int,
            ff: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, shape (n_pos, ne0 / 2), for positions ``pos`` ((n_pos,) or (4, n_pos) for multi-section)."""
    p = params_f32(node)
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = (float(x) for x in p[5:11])
    n_ctx_orig = int(params_i32(node)[4])
    sections = [int(x) for x in params_i32(node)[11:15]]
    half = ne0 // 2
    theta_scale = np.float32(freq_base) ** np.float32(-2.0 / n_dims)
    steps = np.empty(half, dtype=np.float32)  # theta_scale ** i, by repeated float32 products
    acc = np.float32(1)
    for i in range(half):
        steps[i] = acc
        acc = np.float32(acc * theta_scale)
    is_mrope = bool(mode & MODE_MROPE)
    if is_mrope:
        sect_dims = sum(sections)
        if sect_dims <= 0 or sect_dims > ne0 or pos.shape[0] != 4:
            raise node_error(node, "multi-section rope needs 4 position rows and sections summing to 1..ne0")
        sector = np.arange(half) % sect_dims
        s0, s1, s2 = sections[0], sections[1], sections[2]
        if mode == MODE_IMROPE:
            which = np.full(half, 3)
            which[(sector % 3 == 0) & (sector < 3 * s0)] = 0
            which[(sector % 3 == 2) & (sector < 3 * s2)] = 2
            which[(sector % 3 == 1) & (sector < 3 * s1)] = 1
        else:
            which = np.where(sector < s0, 0, np.where(sector < s0 + s1, 1, np.where(sector < s0 + s1 + s2, 2, 3)))
        base = pos[which].T.astype(np.float32)  # (n_pos, half)
        if mode == MODE_VISION:
            # Each section restarts the recurrence at its own first pair.
            starts = np.array([0, s0, s0 + s1, s0 + s1 + s2])
            local = sector - starts[which]
            step = np.empty(half, dtype=np.float32)
            for i in range(half):
                step[i] = steps[local[i]]
            theta = base * step
        else:
            theta = base * steps
    else:
        theta = pos.astype(np.float32)[:, None] * steps
    if ff is not None:
        theta = theta / ff[:half]
    theta_interp = np.float32(freq_scale) * theta
    mscale = np.float32(attn_factor)
    if ext_factor != 0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        y = (np.arange(half, dtype=np.float32) - np.float32(low)) / np.float32(max(0.001, high - low))
        ramp = (1 - np.minimum(1, np.maximum(0, y))) * np.float32(ext_factor)
        theta = theta_interp * (1 - ramp) + theta * ramp
        mscale = np.float32(mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale)))
    else:
        theta = theta_interp
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


@kernel(GgmlOp.ROPE, src=FLOATS, dst=FLOATS, note="normal, NeoX, M-RoPE, iM-RoPE, vision; YaRN")
def _rope(node: GraphTensor, mem: Memory) -> None:
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
    n_pos = ne2 * (4 if is_mrope else 1)
    if pos_t.ne[0] < n_pos:
        raise node_error(node, f"positions tensor holds {int(pos_t.ne[0])} values, {n_pos} needed")
    pos = mem.raw(pos_t).reshape(-1)[:n_pos].astype(np.int64)  # any position is valid: no range to check
    if is_mrope:
        pos = pos.reshape(4, ne2)
    ff = None
    ff_t = node.src[2]
    if ff_t is not None:
        if ff_t.type != F32 or ff_t.ne[0] < n_dims // 2:
            raise node_error(node, "frequency factors must be F32 with at least n_dims / 2 values")
        ff = read(mem, ff_t).reshape(-1)[: n_dims // 2].astype(np.float32)
        ff = np.concatenate((ff, np.ones(ne0 // 2 - ff.size, dtype=np.float32)))
    cos, sin = _angles(node, pos, ne0, n_dims, mode, ff)  # (ne2, ne0/2)
    x = read(mem, a_t)  # (ne3, ne2, ne1, ne0)
    out = np.array(x, dtype=np.float32, copy=True)
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    if mode == 0:
        hd = n_dims // 2
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * c[..., :hd] - x1 * s[..., :hd]
        out[..., 1:n_dims:2] = x0 * s[..., :hd] + x1 * c[..., :hd]
    elif mode == MODE_VISION:
        x0, x1 = x[..., :n_dims], x[..., n_dims : 2 * n_dims]
        out[..., :n_dims] = x0 * c - x1 * s
        out[..., n_dims : 2 * n_dims] = x0 * s + x1 * c
    else:
        hd = n_dims // 2
        x0, x1 = x[..., :hd], x[..., hd:n_dims]
        out[..., :hd] = x0 * c[..., :hd] - x1 * s[..., :hd]
        out[..., hd:n_dims] = x0 * s[..., :hd] + x1 * c[..., :hd]
    write(mem, node, out)
