"""Quantisation and dequantisation: exact block bytes for hand-checkable blocks of every writable quantised type,
round trips, and the vectorised K-quant decoders against plain per-element loops written from the block layouts.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.spec import TYPES

ONE_F16 = b"\x00\x3c"  # 1.0 as little-endian IEEE half


def block_bytes(type_id: int, values: list[float]) -> bytes:
    return ty.quantize(type_id, np.array([values], dtype=np.float32)).tobytes()


def nibbles(q: list[int]) -> bytes:
    """16 bytes: element j in the low nibble, element j + 16 in the high one."""
    return bytes(q[j] | (q[j + 16] << 4) for j in range(16))


def test_q8_0_exact_block():
    x = [-127.0, -1.5, -0.5, 0.5, 1.5, 2.49, 127.0, 0.0] + [float(v) for v in range(24)]
    got = block_bytes(ty.Q8_0, x)
    # amax 127 -> d = 1.0; codes round halves to even, as ggml's x86 CPU backend does (upstream's CPY F32 -> Q8_0
    # of this block gives 0 for 0.5 and -0.5, 2 for 1.5 and 2.5).
    want_q = [-127, -2, 0, 0, 2, 2, 127, 0, *range(24)]
    assert got == ONE_F16 + struct.pack("32b", *want_q)
    assert ty.dequantize(ty.Q8_0, np.frombuffer(got, np.uint8).reshape(1, 34)).tolist() == [float(v) for v in want_q]


def test_q8_0_codes_scale_by_127_over_amax():
    # 1 / (amax / 127) and 127 / amax differ by one ulp for this amax, enough to move 0.03272703 from code 2 to 1;
    # upstream's CPU backend (CPY F32 -> Q8_0 of this very block, 6.0.0 x86-64-v3 build) answers 1.
    got = block_bytes(ty.Q8_0, [2.7708886, 0.03272703] + [0.0] * 30)
    assert got[:2] == np.float16(2.7708886 / 127).tobytes()
    assert list(np.frombuffer(got[2:4], np.int8)) == [127, 1]


def test_round_op_has_no_half_trap():
    # C roundf: 0.49999997 + 0.5 rounds to 1.0 in float32, but 0.49999997 itself rounds to 0.
    x = np.array([0.49999997, -0.49999997, 0.5, -0.5, 2.5], dtype=np.float32)
    assert ty.round_away(x).tolist() == [0.0, 0.0, 1.0, -1.0, 3.0]


def test_q4_0_exact_block():
    # Value of largest magnitude -8 -> d = -8 / -8 = 1; code = min(15, trunc(x + 8.5)).
    x = [-8.0, 7.0, 0.0, 0.49, 0.5, -0.5, 3.2, -3.7] + [0.0] * 8 + [1.0] * 8 + [-1.0] * 8
    got = block_bytes(ty.Q4_0, x)
    q = [0, 15, 8, 8, 9, 8, 11, 4] + [8] * 8 + [9] * 8 + [7] * 8
    assert got == ONE_F16 + nibbles(q)
    back = ty.dequantize(ty.Q4_0, np.frombuffer(got, np.uint8).reshape(1, 18))
    assert back.tolist() == [float(v - 8) for v in q]


def test_q4_1_exact_block():
    # min 0, max 15 -> d = 1, m = 0; code = min(15, trunc(x - min + 0.5)).
    x = [0.0, 15.0, 7.4, 7.5, 3.0] + [1.0] * 27
    got = block_bytes(ty.Q4_1, x)
    q = [0, 15, 7, 8, 3] + [1] * 27
    assert got == ONE_F16 + b"\x00\x00" + nibbles(q)
    back = ty.dequantize(ty.Q4_1, np.frombuffer(got, np.uint8).reshape(1, 20))
    assert back.tolist() == [float(v) for v in q]


def test_q5_0_exact_block():
    # Largest magnitude -16 -> d = 1; code = min(31, trunc(x + 16.5)); bit 4 of code j goes to qh bit j.
    x = [-16.0, 15.0, 0.0, 1.0, -1.0] + [2.0] * 11 + [-2.0] * 16
    got = block_bytes(ty.Q5_0, x)
    q = [0, 31, 16, 17, 15] + [18] * 11 + [14] * 16
    qh = sum(((v >> 4) & 1) << j for j, v in enumerate(q))
    assert got == ONE_F16 + struct.pack("<I", qh) + nibbles([v & 15 for v in q])
    back = ty.dequantize(ty.Q5_0, np.frombuffer(got, np.uint8).reshape(1, 22))
    assert back.tolist() == [float(v - 16) for v in q]


def test_q5_1_exact_block():
    x = [0.0, 31.0, 16.0, 15.6] + [4.0] * 28
    got = block_bytes(ty.Q5_1, x)
    q = [0, 31, 16, 16] + [4] * 28
    qh = sum(((v >> 4) & 1) << j for j, v in enumerate(q))
    assert got == ONE_F16 + b"\x00\x00" + struct.pack("<I", qh) + nibbles([v & 15 for v in q])
    back = ty.dequantize(ty.Q5_1, np.frombuffer(got, np.uint8).reshape(1, 24))
    assert back.tolist() == [float(v) for v in q]


def test_iq4_nl_exact_block():
    # Values exactly on the levels: d0 = -127 / -127 = 1 picks them, the weighted scale is then exactly 1.
    levels = ty.IQ4NL_LEVELS.tolist()
    idx = [0, 15, 8, 7, 3, 12, *range(16), *range(10)]
    got = block_bytes(ty.IQ4_NL, [float(levels[i]) for i in idx])
    assert got == ONE_F16 + nibbles(idx)
    back = ty.dequantize(ty.IQ4_NL, np.frombuffer(got, np.uint8).reshape(1, 18))
    assert back.tolist() == [float(levels[i]) for i in idx]


def test_iq4_nl_nearest_level_ties_go_up():
    # Halfway between -10 and 1 is -4.5: the lower level is chosen only when strictly nearer.
    assert ty.nearest_level(np.array([-4.5, -4.6, -200.0, 200.0], dtype=np.float32)).tolist() == [8, 7, 0, 15]


def test_zero_blocks_quantise_to_zero():
    for t in (ty.Q8_0, ty.Q4_0, ty.Q4_1, ty.Q5_0, ty.Q5_1, ty.IQ4_NL):
        blocks = ty.quantize(t, np.zeros((2, 32), dtype=np.float32))
        assert not ty.dequantize(t, blocks).any()


@pytest.mark.parametrize(("t", "max_nmse"), [(ty.Q8_0, 1e-4), (ty.Q4_0, 2e-2), (ty.Q4_1, 2e-2), (ty.Q5_0, 5e-3),
                                            (ty.Q5_1, 5e-3), (ty.IQ4_NL, 2e-2), (ty.Q8_K, 1e-4), (ty.Q8_1, 1e-4)])
def test_round_trip_error_is_small(t, max_nmse):
    x = np.random.default_rng(t).standard_normal((8, 512)).astype(np.float32)
    y = ty.dequantize(t, ty.quantize(t, x))
    assert y.shape == x.shape
    assert float(((y - x) ** 2).sum() / (x**2).sum()) < max_nmse
    # Quantising what came back reproduces the same blocks (the codes are a fixed point).
    if t not in (ty.IQ4_NL, ty.Q8_1, ty.Q8_K):  # their scales are not recomputed exactly from the codes
        assert np.array_equal(ty.dequantize(t, ty.quantize(t, y)), y)


def test_bf16_rounding_and_nan():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.inf, np.nan], dtype=np.float32)
    bits = ty.f32_to_bf16(x)
    # 1 + 2^-8 is a tie: to even (1.0); 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    assert bits[:5].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80]
    assert np.isnan(ty.bf16_to_f32(bits[5:]))[0]
    assert ty.bf16_to_f32(bits[:5]).tolist() == [1.0, 1.0, 1 + 2**-6, -2.5, np.inf]


# ---- K-quants: vectorised decoders vs per-element loops over the documented layouts -------------------------


def _h(b: bytes, at: int) -> float:
    return float(np.frombuffer(b[at : at + 2], "<f2")[0])


def _scale_min_k4(j: int, s: bytes) -> tuple[int, int]:
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def loop_q2_k(b: bytes) -> list[float]:
    scales, qs, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
    y, k = [], 0
    for n in range(2):
        q = qs[32 * n : 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                sc = scales[k]
                k += 1
                for lane in range(16):
                    y.append(d * (sc & 0xF) * ((q[16 * half + lane] >> shift) & 3) - dmin * (sc >> 4))
    return y


def loop_q3_k(b: bytes) -> list[float]:
    hmask, qs, raw, d = b[0:32], b[32:96], b[96:108], _h(b, 108)
    a0, a1, t = struct.unpack("<3I", raw)
    packed = [
        (a0 & 0x0F0F0F0F) | (((t >> 0) & 0x03030303) << 4),
        (a1 & 0x0F0F0F0F) | (((t >> 2) & 0x03030303) << 4),
        ((a0 >> 4) & 0x0F0F0F0F) | (((t >> 4) & 0x03030303) << 4),
        ((a1 >> 4) & 0x0F0F0F0F) | (((t >> 6) & 0x03030303) << 4),
    ]
    scales = [v - 32 for v in struct.pack("<4I", *packed)]
    y, k, m = [], 0, 1
    for n in range(2):
        q = qs[32 * n : 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                dl = d * scales[k]
                k += 1
                for lane in range(16):
                    i = 16 * half + lane
                    y.append(dl * (((q[i] >> shift) & 3) - (0 if hmask[i] & m else 4)))
            m <<= 1
    return y


def loop_q4_k(b: bytes) -> list[float]:
    d, dmin, s, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:144]
    y = []
    for c in range(4):
        for half in range(2):
            sc, mn = _scale_min_k4(2 * c + half, s)
            for lane in range(32):
                v = qs[32 * c + lane]
                y.append(d * sc * ((v >> (4 * half)) & 0xF) - dmin * mn)
    return y


def loop_q5_k(b: bytes) -> list[float]:
    d, dmin, s, qh, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:48], b[48:176]
    y = []
    for c in range(4):
        for half in range(2):
            j = 2 * c + half
            sc, mn = _scale_min_k4(j, s)
            for lane in range(32):
                v = ((qs[32 * c + lane] >> (4 * half)) & 0xF) + (16 if qh[lane] & (1 << j) else 0)
                y.append(d * sc * v - dmin * mn)
    return y


def loop_q6_k(b: bytes) -> list[float]:
    ql, qh, sc, d = b[0:128], b[128:192], struct.unpack("16b", b[192:208]), _h(b, 208)
    y = [0.0] * 256
    for n in range(2):
        for lane in range(32):
            h = qh[32 * n + lane]
            lo0, lo1 = ql[64 * n + lane], ql[64 * n + lane + 32]
            is_ = 8 * n + lane // 16
            y[128 * n + lane] = d * sc[is_] * (((lo0 & 0xF) | ((h & 3) << 4)) - 32)
            y[128 * n + lane + 32] = d * sc[is_ + 2] * (((lo1 & 0xF) | (((h >> 2) & 3) << 4)) - 32)
            y[128 * n + lane + 64] = d * sc[is_ + 4] * (((lo0 >> 4) | (((h >> 4) & 3) << 4)) - 32)
            y[128 * n + lane + 96] = d * sc[is_ + 6] * (((lo1 >> 4) | (((h >> 6) & 3) << 4)) - 32)
    return y


K_QUANTS = [(ty.Q2_K, loop_q2_k, (80, 82)), (ty.Q3_K, loop_q3_k, (108,)), (ty.Q4_K, loop_q4_k, (0, 2)),
            (ty.Q5_K, loop_q5_k, (0, 2)), (ty.Q6_K, loop_q6_k, (208,))]


@pytest.mark.parametrize(("t", "loop", "half_at"), K_QUANTS)
def test_k_quant_dequantisation_matches_layout_loops(t, loop, half_at):
    rng = np.random.default_rng(t)
    size = TYPES[t].size
    blocks = rng.integers(0, 256, size=(3, size), dtype=np.uint8)
    for at in half_at:  # sane scales so the comparison is about layout, not about inf/nan
        blocks[:, at : at + 2] = np.array(rng.uniform(0.01, 1.0, size=(3, 1)), dtype="<f2").view(np.uint8)
    got = ty.dequantize(t, blocks.reshape(1, 3, size))
    assert got.shape == (1, 768)
    want = np.array([loop(bytes(row)) for row in blocks], dtype=np.float32).reshape(1, 768)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_k_quant_hand_block_q4_k():
    # d = 1, dmin = 0.5; sub-block j: scale j + 1, min j (j < 4: 6-bit fields in bytes 0..7, high bits 0).
    scales = bytes([1, 2, 3, 4, 0, 1, 2, 3, 0x55, 0x66, 0x77, 0x88])
    qs = bytes([0x21] * 128)  # low nibble 1, high nibble 2
    block = ONE_F16 + b"\x00\x38" + scales + qs
    got = ty.dequantize(ty.Q4_K, np.frombuffer(block, np.uint8).reshape(1, 144))
    # Sub-block 0: 1 * 1 * 1 - 0.5 * 0; sub-block 1: 1 * 2 * 2 - 0.5 * 1.
    assert got[0] == 1.0 and got[32] == 3.5
    # Sub-block 4 (j >= 4): scale = (0x55 & 0xF) | ((1 >> 6) << 4) = 5, min = 0x55 >> 4 | 0 = 5 -> 5 * 1 - 2.5.
    assert got[128] == 2.5
    assert got.tolist() == pytest.approx(loop_q4_k(block))
