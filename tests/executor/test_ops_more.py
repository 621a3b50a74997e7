"""More per-op tests against independent numpy formulations: SET_ROWS with broadcast indices and F16 sources,
copies between quantised tensors of different shapes, and (further down) the ops added for test-backend-ops."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.spec import GgmlOp, GgmlType, GluOp

from .test_ops import filled, permuted, rand

F32, F16 = int(GgmlType.F32), int(GgmlType.F16)
I32, I64 = int(GgmlType.I32), int(GgmlType.I64)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 21)


def set_rows_node(arena: Arena, dst, src, idx):
    out = arena.view_of(dst, tuple(dst.ne), dst.nb, op=GgmlOp.SET_ROWS)
    out.src = [src, idx, dst, *([None] * 7)]
    out.flags = 16
    return out


@pytest.mark.parametrize("idx_type", [I32, I64])
@pytest.mark.parametrize(("dst_type", "src_type"), [(F32, F32), (F16, F32), (F32, F16), (int(GgmlType.Q4_K), F32),
                                                    (int(GgmlType.Q1_0), F16)])
def test_set_rows_broadcasts_indices_over_dims_2_and_3(arena, idx_type, dst_type, src_type):
    ne0 = 256 if dst_type not in (F32, F16) else 3
    dst_vals = rand(4, 2, 6, ne0)  # dst [ne0, 6, 2, 4]
    src_vals = rand(4, 2, 3, ne0, seed=1)  # three rows per (i2, i3)
    rows = np.array([[[5, 0, 2]], [[1, 4, 3]]])  # idx [3, 1, 2]: shared over dim 2, alternating over dim 3
    dst = filled(arena, dst_type, (ne0, 6, 2, 4), dst_vals)
    src = filled(arena, src_type, (ne0, 3, 2, 4), src_vals)
    idx = arena.tensor(idx_type, (3, 1, 2))
    arena.set_raw(idx, rows.astype(np.int32 if idx_type == I32 else np.int64))
    before = arena.get(dst).copy()
    execute([set_rows_node(arena, dst, src, idx)])
    src_read = src_vals.astype(np.float16).astype(np.float32) if src_type == F16 else src_vals
    want = before.copy()
    for i3 in range(4):
        for i2 in range(2):
            for i1 in range(3):
                want[i3, i2, rows[i3 % 2, i2 % 1, i1]] = ty.through_type(dst_type, src_read[i3, i2, i1][None])[0]
    np.testing.assert_array_equal(arena.get(dst), want)


def test_set_rows_from_a_permuted_source(arena):
    src_vals = rand(1, 1, 4, 2)  # src [2, 4]: rows of two values, stored transposed
    src = permuted(arena, src_vals)
    dst = filled(arena, F32, (2, 5), np.zeros((1, 1, 5, 2), np.float32))
    idx = arena.tensor(I64, (4,))
    arena.set_raw(idx, np.array([4, 0, 3, 1], np.int64))
    execute([set_rows_node(arena, dst, src, idx)])
    want = np.zeros((5, 2), np.float32)
    want[[4, 0, 3, 1]] = src_vals[0, 0]
    np.testing.assert_array_equal(arena.get(dst)[0, 0], want)


def test_same_type_quantised_copy_walks_a_permuted_source_block_by_block(arena):
    q = int(GgmlType.Q2_K)
    vals = rand(1, 3, 2, 256)
    base = filled(arena, q, (256, 2, 3), vals)
    nb = base.nb
    perm = arena.view_of(base, (256, 3, 2), (nb[0], nb[2], nb[1], nb[3]), op=GgmlOp.PERMUTE)
    out = arena.tensor(q, (256, 3, 2), op=GgmlOp.CPY, src=(perm,))
    execute([out])
    np.testing.assert_array_equal(arena.raw(out)[0], arena.raw(base)[0].transpose(1, 0, 2, 3))


@pytest.mark.parametrize("swapped", [0, 1])
def test_fused_glu_of_an_odd_width_takes_the_floor_and_drops_the_last_column(arena, swapped):
    x = rand(1, 2, 3, 9)  # width 9 -> halves of 4, column 8 unused
    a = filled(arena, F32, (9, 3, 2), x)
    out = arena.tensor(F32, (4, 3, 2), op=GgmlOp.GLU, src=(a,), params=params(int(GluOp.REGLU), swapped))
    execute([out])
    gate, lin = (x[..., 4:8], x[..., 0:4]) if swapped else (x[..., 0:4], x[..., 4:8])
    np.testing.assert_array_equal(arena.get(out), np.maximum(gate, 0) * lin)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_of_quantised_sources_joins_whole_blocks(arena, dim):
    q = int(GgmlType.Q4_0)
    ne_a = [64, 2, 3, 2]
    ne_b = list(ne_a)
    ne_b[dim] = 32 if dim == 0 else 1
    a = filled(arena, q, tuple(ne_a), rand(*ne_a[::-1]))
    b = filled(arena, q, tuple(ne_b), rand(*ne_b[::-1], seed=1))
    ne_o = list(ne_a)
    ne_o[dim] += ne_b[dim]
    out = arena.tensor(q, tuple(ne_o), op=GgmlOp.CONCAT, src=(a, b), params=params(dim))
    execute([out])
    # Values, not just bytes: the joined tensor reads back as the two sources' values side by side.
    np.testing.assert_array_equal(arena.get(out), np.concatenate((arena.get(a), arena.get(b)), axis=3 - dim))


def rope_params(n_dims, mode, *, n_ctx_orig=0, base=10000.0, fs=1.0, ef=0.0, af=1.0, bf=32.0, bs=1.0, off=0,
                sections=(0, 0, 0, 0)):
    p = np.zeros(16, np.int32)
    p[1], p[2], p[4], p[15] = n_dims, mode, n_ctx_orig, off
    p[5:11] = np.array([base, fs, ef, af, bf, bs], np.float32).view(np.int32)
    p[11:15] = sections
    return p


def yarn_reference(pos, n_dims, half, *, n_ctx_orig, base, fs, ef, af, bf, bs):
    """cos/sin (n_pos, half) from YaRN's definition in float64 (C's MAX/MIN semantics for the -inf range)."""
    i = np.arange(half)
    theta_ex = pos[:, None] * base ** (-2.0 * i / n_dims)
    theta_in = fs * theta_ex
    mscale = af
    if ef:
        with np.errstate(divide="ignore"):
            def corr(n_rot):
                return n_dims * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))
            low, high = max(0.0, np.floor(corr(bf))), min(n_dims - 1.0, np.ceil(corr(bs)))
        y = (i - low) / max(0.001, high - low)
        ramp = (1 - np.clip(y, 0, 1)) * ef
        theta = theta_in * (1 - ramp) + theta_ex * ramp
        mscale = af * (1 + 0.1 * np.log(1 / fs))
    else:
        theta = theta_in
    return np.cos(theta) * mscale, np.sin(theta) * mscale


@pytest.mark.parametrize(("mode", "off", "yarn"), [(0, 0, False), (2, 0, False), (0, 4, True), (2, 2, True),
                                                   (2, 0, True)])
@pytest.mark.parametrize("op", [GgmlOp.ROPE, GgmlOp.ROPE_BACK])
def test_rope_offset_yarn_and_back_on_a_permuted_source(arena, mode, off, yarn, op):
    ne0, ne1, ne2, n_dims = 16, 3, 2, 8
    x = rand(1, ne2, ne1, ne0)
    # A permuted source: dims 1 and 2 swapped in memory.
    base_t = filled(arena, F32, (ne0, ne2, ne1), x.transpose(0, 2, 1, 3))
    nb = base_t.nb
    a = arena.view_of(base_t, (ne0, ne1, ne2), (nb[0], nb[2], nb[1], nb[3]), op=GgmlOp.PERMUTE)
    pos_vals = np.array([3, 250], np.int32)
    pos = arena.tensor(I32, (ne2,))
    arena.set_raw(pos, pos_vals)
    kw = {"n_ctx_orig": 0, "fs": 1.4245, "ef": 0.7465, "af": 1.4245, "bf": 1.0, "bs": 1.0} if yarn else {}
    out = arena.tensor(F32, (ne0, ne1, ne2), op=op, src=(a, pos), params=rope_params(n_dims, mode, off=off, **kw))
    execute([out])
    ref = {"n_ctx_orig": 0, "base": 10000.0, "fs": 1.0, "ef": 0.0, "af": 1.0, "bf": 32.0, "bs": 1.0} | kw
    cos, sin = yarn_reference(pos_vals.astype(np.float64), n_dims, n_dims // 2, **ref)
    if op == GgmlOp.ROPE_BACK:
        sin = -sin
    want = x.astype(np.float64).copy()
    seg = want[..., off:off + n_dims]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if mode == 0:
        x0, x1 = seg[..., 0::2].copy(), seg[..., 1::2].copy()
        seg[..., 0::2], seg[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        x0, x1 = seg[..., : n_dims // 2].copy(), seg[..., n_dims // 2:].copy()
        seg[..., : n_dims // 2], seg[..., n_dims // 2:] = x0 * c - x1 * s, x0 * s + x1 * c
    np.testing.assert_allclose(arena.get(out), want, rtol=2e-4, atol=2e-5)


def test_rope_back_undoes_rope(arena):
    x = rand(1, 2, 3, 8)
    a = filled(arena, F32, (8, 3, 2), x)
    pos = arena.tensor(I32, (2,))
    arena.set_raw(pos, np.array([7, 19], np.int32))
    fwd = arena.tensor(F32, (8, 3, 2), op=GgmlOp.ROPE, src=(a, pos), params=rope_params(8, 2))
    back = arena.tensor(F32, (8, 3, 2), op=GgmlOp.ROPE_BACK, src=(fwd, pos), params=rope_params(8, 2))
    execute([fwd, back])
    np.testing.assert_allclose(arena.get(back), x, rtol=1e-5, atol=1e-6)


def test_vision_rope_uses_a_frequency_factor_for_every_pair(arena):
    ne0, n_dims = 8, 4
    x = rand(1, 1, 1, ne0)
    a = filled(arena, F32, (ne0, 1, 1), x)
    pos = arena.tensor(I32, (4,))
    arena.set_raw(pos, np.array([5, 2, 3, 0], np.int32))  # t, h, w, e of the one position
    ff_vals = np.array([1.0, 2.0, 4.0, 0.5], np.float32)  # ne0 / 2 factors; the last two rotate the second half
    ff = filled(arena, F32, (4,), ff_vals)
    params = rope_params(n_dims, 24, sections=(2, 2, 0, 0))
    out = arena.tensor(F32, (ne0, 1, 1), op=GgmlOp.ROPE, src=(a, pos, ff), params=params)
    execute([out])
    # Sections of 2 pairs: pairs 0-1 use t = 5, pairs 2-3 use h = 2, each section restarting theta_scale^0.
    scale = 10000.0 ** (-2.0 / n_dims)
    theta = np.array([5, 5 * scale, 2, 2 * scale]) / ff_vals
    x0, x1 = x[0, 0, 0, :4], x[0, 0, 0, 4:]
    want = np.concatenate((x0 * np.cos(theta) - x1 * np.sin(theta), x0 * np.sin(theta) + x1 * np.cos(theta)))
    np.testing.assert_allclose(arena.get(out)[0, 0, 0], want, rtol=1e-5, atol=1e-6)


# ---- convolutions and pooling ------------------------------------------------------------------------------------


def conv_out(size, k, s, p, d):
    return int((size + 2 * p - d * (k - 1) - 1) / s) + 1  # C division, truncating toward zero


def test_im2col_1d_ignores_the_unused_second_axis_params(arena):
    x = rand(1, 1, 2, 7)  # input [W=7, C=2]
    a = filled(arena, F32, (7, 2), x)
    k = arena.tensor(F32, (3, 2))  # kernel [KW=3, C=2]: only its shape is read
    ow = conv_out(7, 3, 2, 1, 1)
    out = arena.tensor(F32, (6, ow, 1), op=GgmlOp.IM2COL, src=(k, a), params=params(2, 0, 1, 0, 1, 0, 0))
    execute([out])
    xp = np.pad(x[0, 0], ((0, 0), (1, 1)))
    want = np.stack([xp[:, 2 * o : 2 * o + 3].reshape(-1) for o in range(ow)])  # (OW, C*KW)
    np.testing.assert_array_equal(arena.get(out)[0, 0], want)


def test_conv_2d_window_overhanging_the_padded_input_still_gives_one_output(arena):
    # H = 2, KH = 3, p1 = 0, s1 = 2: (2 - 2 - 1) / 2 + 1 = 1 in C (0 with floor division: no output at all).
    x = rand(1, 1, 2, 4)
    a = filled(arena, F32, (4, 2, 1, 1), x)
    k_vals = rand(1, 1, 3, 1, seed=1)
    k = filled(arena, F32, (1, 3, 1, 1), k_vals)
    oh = conv_out(2, 3, 2, 0, 1)
    assert oh == 1
    out = arena.tensor(F32, (4, oh, 1, 1), op=GgmlOp.CONV_2D, src=(k, a), params=params(1, 2, 0, 0, 1, 1))
    execute([out])
    # Kernel rows 0 and 1 meet the two input rows; row 2 falls outside.
    want = x[0, 0, 0] * k_vals[0, 0, 0, 0] + x[0, 0, 1] * k_vals[0, 0, 1, 0]
    np.testing.assert_allclose(arena.get(out)[0, 0, 0], want, rtol=1e-6)


def direct_conv_3d(x, kern, s, p, d):
    """x (N, C, D, H, W), kern (OC, C, KD, KH, KW); s, p, d width first. Plain loops over output positions."""
    n, c, dd, hh, ww = x.shape
    oc, _, kd, kh, kw = kern.shape
    od, oh, ow = (conv_out(dd, kd, s[2], p[2], d[2]), conv_out(hh, kh, s[1], p[1], d[1]),
                  conv_out(ww, kw, s[0], p[0], d[0]))
    xp = np.zeros((n, c, dd + 2 * p[2] + kd * d[2], hh + 2 * p[1] + kh * d[1], ww + 2 * p[0] + kw * d[0]))
    xp[:, :, p[2]:p[2] + dd, p[1]:p[1] + hh, p[0]:p[0] + ww] = x
    out = np.zeros((n, oc, od, oh, ow))
    cols = np.zeros((n, od, oh, ow, c, kd, kh, kw))
    for z in range(od):
        for y in range(oh):
            for t in range(ow):
                patch = xp[:, :, z * s[2]: z * s[2] + kd * d[2]: d[2], y * s[1]: y * s[1] + kh * d[1]: d[1],
                           t * s[0]: t * s[0] + kw * d[0]: d[0]]
                cols[:, z, y, t] = patch
                out[:, :, z, y, t] = np.einsum("ncijk,ocijk->no", patch, kern)
    return cols, out


def test_im2col_3d_and_conv_3d_against_direct_loops(arena):
    n, c, oc = 2, 3, 2
    dd, hh, ww, kd, kh, kw = 3, 4, 5, 2, 2, 3
    s, p, d = (2, 1, 1), (1, 0, 1), (1, 2, 1)
    x = rand(n, c, dd, hh, ww)
    kern = rand(oc, c, kd, kh, kw, seed=1)
    xt = filled(arena, F32, (ww, hh, dd, n * c), x.reshape(n * c, dd, hh, ww))
    kt = filled(arena, F32, (kw, kh, kd, oc * c), kern.reshape(oc * c, kd, kh, kw))
    cols, want = direct_conv_3d(x.astype(np.float64), kern.astype(np.float64), s, p, d)
    od, oh, ow = cols.shape[1:4]
    ic_cols = arena.tensor(F32, (kw * kh * kd * c, ow, oh, od * n), op=GgmlOp.IM2COL_3D, src=(kt, xt),
                           params=params(*s, *p, *d, c))
    conv = arena.tensor(F32, (ow, oh, od, oc * n), op=GgmlOp.CONV_3D, src=(kt, xt), params=params(*s, *p, *d, c, n, oc))
    execute([ic_cols, conv])
    np.testing.assert_allclose(arena.get(ic_cols).reshape(cols.shape), cols, rtol=1e-6)
    np.testing.assert_allclose(arena.get(conv).reshape(want.shape), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("op", "k0", "s0", "p0"), [(0, 3, 2, 1), (1, 2, 1, 1), (1, 3, 2, 2)])
def test_pool_1d_on_a_permuted_input(arena, op, k0, s0, p0):
    x = rand(1, 2, 3, 7)
    a = permuted(arena, x)
    ow = (7 + 2 * p0 - k0) // s0 + 1
    out = arena.tensor(F32, (ow, 3, 2), op=GgmlOp.POOL_1D, src=(a,), params=params(op, k0, s0, p0))
    execute([out])
    want = np.empty((1, 2, 3, ow), np.float32)
    for o in range(ow):
        lo, hi = o * s0 - p0, o * s0 - p0 + k0
        seg = x[..., max(lo, 0):min(hi, 7)]  # padding never wins a max and is not counted in an average
        want[..., o] = seg.max(-1) if op == 0 else seg.mean(-1)
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-6)


# ---- layout ops ----------------------------------------------------------------------------------------------------


def test_conv_transpose_1d_against_a_scatter_loop(arena):
    k, oc, ic, length, s0 = 3, 2, 4, 5, 2
    kern = rand(1, ic, oc, k)
    x = rand(1, 1, ic, length, seed=1)
    kt = filled(arena, F32, (k, oc, ic), kern)
    xt = filled(arena, F32, (length, ic), x)
    out_len = (length - 1) * s0 + k
    out = arena.tensor(F32, (out_len, oc), op=GgmlOp.CONV_TRANSPOSE_1D, src=(kt, xt), params=params(s0, 0, 1))
    execute([out])
    want = np.zeros((oc, out_len))
    for c in range(ic):
        for o in range(oc):
            for t in range(length):
                want[o, t * s0 : t * s0 + k] += x[0, 0, c, t] * kern[0, c, o]
    np.testing.assert_allclose(arena.get(out)[0, 0], want, rtol=1e-5, atol=1e-6)


def test_circular_pad_wraps_every_dim(arena):
    x = rand(1, 2, 3, 4)
    a = permuted(arena, x)
    p = (1, 2, 2, 1, 0, 1, 0, 0)  # left/right per dim 0..3
    ne = (4 + 3, 3 + 3, 2 + 1, 1)
    out = arena.tensor(F32, ne, op=GgmlOp.PAD, src=(a,), params=params(*p, 1))
    execute([out])
    want = np.pad(x, ((0, 0), (0, 1), (2, 1), (1, 2)), mode="wrap")
    np.testing.assert_array_equal(arena.get(out), want)


def test_pad_reflect_roll_and_diag(arena):
    x = rand(1, 2, 3, 6)
    a = permuted(arena, x)
    refl = arena.tensor(F32, (6 + 3 + 2, 3, 2), op=GgmlOp.PAD_REFLECT_1D, src=(a,), params=params(3, 2))
    roll = arena.tensor(F32, (6, 3, 2), op=GgmlOp.ROLL, src=(a,), params=params(-2, 1, 0, 0))
    row = filled(arena, F32, (5, 1, 2), rand(1, 2, 1, 5, seed=2))
    diag = arena.tensor(F32, (5, 5, 2), op=GgmlOp.DIAG, src=(row,))
    execute([refl, roll, diag])
    np.testing.assert_array_equal(arena.get(refl), np.pad(x, ((0, 0), (0, 0), (0, 0), (3, 2)), mode="reflect"))
    # dim 0 rolled by -2, dim 1 by +1
    np.testing.assert_array_equal(arena.get(roll), x[:, :, [2, 0, 1], :][..., [2, 3, 4, 5, 0, 1]])
    d = arena.get(diag)[0]
    for b in range(2):
        np.testing.assert_array_equal(d[b], np.diag(arena.get(row)[0, b, 0]))


def test_set_of_i32_tensors_copies_values_exactly(arena):
    big = arena.tensor(I32, (6, 3))
    arena.set_raw(big, np.arange(18, dtype=np.int32).reshape(1, 1, 3, 6) + (1 << 30))
    small = arena.tensor(I32, (2, 2))
    arena.set_raw(small, np.array([[7, 8], [9, 10]], np.int32).reshape(1, 1, 2, 2))
    nb1 = 6 * 4
    out = arena.tensor(I32, (6, 3), op=GgmlOp.SET, src=(big, small), params=params(nb1, nb1 * 3, nb1 * 3, 4 * 7, 0))
    execute([out])
    want = np.arange(18, dtype=np.int32).reshape(3, 6) + (1 << 30)
    want[1, 1:3], want[2, 1:3] = [7, 8], [9, 10]  # offset 7 elements = row 1, column 1
    np.testing.assert_array_equal(arena.raw(out)[0, 0], want)


def test_bilinear_upscale_takes_nearest_neighbours_in_dims_2_and_3(arena):
    x = rand(3, 2, 2, 2)
    a = filled(arena, F32, (2, 2, 2, 3), x)
    out = arena.tensor(F32, (2, 2, 5, 2), op=GgmlOp.UPSCALE, src=(a,), params=params(1))
    execute([out])
    # dims 0/1 unchanged (bilinear at scale 1 reproduces them); dim 2: 2 -> 5, dim 3: 3 -> 2 by trunc(i / sf).
    i2 = (np.arange(5) / np.float32(5 / 2)).astype(int)
    i3 = (np.arange(2) / np.float32(2 / 3)).astype(int)
    np.testing.assert_allclose(arena.get(out), x[i3][:, i2], rtol=1e-6)


def keys_kernel(x: float, a: float = -0.75) -> float:
    x = abs(x)
    if x <= 1:
        return (a + 2) * x**3 - (a + 3) * x**2 + 1
    return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a if x < 2 else 0.0


def test_bicubic_upscale_against_the_keys_kernel(arena):
    x = rand(1, 1, 3, 5)
    a = filled(arena, F32, (5, 3), x)
    out = arena.tensor(F32, (9, 3), op=GgmlOp.UPSCALE, src=(a,), params=params(2))
    execute([out])
    want = np.zeros((3, 9))
    for o in range(9):
        pos = (o + 0.5) / (9 / 5) - 0.5
        base = int(np.floor(pos))
        for off in (-1, 0, 1, 2):
            src_i = min(max(base + off, 0), 4)  # edge pixels repeat
            want[:, o] += x[0, 0, :, src_i] * keys_kernel(pos - (base + off))
    np.testing.assert_allclose(arena.get(out)[0, 0], want, rtol=1e-5, atol=1e-5)


def test_upscale_to_one_pixel_with_aligned_corners_takes_the_first(arena):
    x = rand(1, 1, 1, 4)
    a = filled(arena, F32, (4,), x)
    for mode in (1, 2):
        out = arena.tensor(F32, (1,), op=GgmlOp.UPSCALE, src=(a,), params=params(mode | (1 << 8)))
        execute([out])
        np.testing.assert_allclose(arena.get(out).reshape(-1), x.reshape(-1)[:1], rtol=1e-6)


def test_swiglu_clamp_clamps_gate_above_and_linear_half_both_ways(arena):
    # Independent formulation: silu(min(g, L)) * clip(u, -L, L), with L the float in op_params[3].
    limit = 0.75
    g_vals, u_vals = 3 * rand(1, 2, 3, 5), 3 * rand(1, 2, 3, 5, seed=1)
    g_src = filled(arena, F32, (5, 3, 2), g_vals)
    u_src = filled(arena, F32, (5, 3, 2), u_vals)
    out = arena.tensor(F32, (5, 3, 2), op=GgmlOp.GLU, src=(g_src, u_src),
                       params=params(int(GluOp.SWIGLU_CLAMP), 0, 0, limit))
    execute([out])
    g = np.minimum(g_vals.astype(np.float64), limit)
    want = g / (1 + np.exp(-g)) * np.clip(u_vals, -limit, limit)
    np.testing.assert_allclose(arena.get(out), want, rtol=1e-6, atol=1e-7)
    assert (np.abs(arena.get(out)) > 0).any() and (np.abs(u_vals) > limit).any() and (g_vals > limit).any()
