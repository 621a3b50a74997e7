"""Q1_0, Q2_0, MXFP4, NVFP4, TQ1_0, TQ2_0 and IQ4_XS: exact block bytes of hand-checkable blocks, decoders against
plain per-element loops written from the block layouts, round trips, and (with the upstream peers installed)
bit-for-bit agreement with ggml's own quantisers and dequantisers on thousands of random blocks."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import types as ty
from ggml_rpc.spec import TYPES

NEW_TYPES = (ty.Q1_0, ty.Q2_0, ty.MXFP4, ty.NVFP4, ty.TQ1_0, ty.TQ2_0, ty.IQ4_XS)
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def quant(t: int, values) -> bytes:
    return ty.quantize(t, np.asarray([values], dtype=np.float32)).tobytes()


def dequant(t: int, raw: bytes) -> list[float]:
    return ty.dequantize(t, np.frombuffer(raw, np.uint8).reshape(1, -1, TYPES[t].size)).reshape(-1).tolist()


def half(v: float) -> bytes:
    return np.float16(v).tobytes()


def test_q1_0_exact_block():
    x = [1.0, -1.0, 0.0, -0.0, 3.0] + [-1.0] * 123
    got = quant(ty.Q1_0, x)
    # d = mean |x| = 128 / 128; bits set for x >= 0 (0.0 and -0.0 both count as non-negative).
    bits = [1, 0, 1, 1, 1] + [0] * 123
    want = bytes(sum(bits[8 * k + j] << j for j in range(8)) for k in range(16))
    assert got == half(1.0) + want
    assert dequant(ty.Q1_0, got) == [1.0 if b else -1.0 for b in bits]


def test_q2_0_exact_block():
    x = [2.0, -2.0, 1.0, 0.9, -1.0, 0.0, 0.5, -0.5] + [0.0] * 56
    got = quant(ty.Q2_0, x)
    # d = max |x| = 2; codes round(x / 2) + 1 with halves away from zero: 1 -> 0.5 -> 1 -> code 2, -1 -> code 0,
    # 0.9 -> 0.45 -> code 1.
    codes = [2, 0, 2, 1, 0, 1, 1, 1] + [1] * 56
    want = bytes(sum(codes[4 * k + j] << (2 * j) for j in range(4)) for k in range(16))
    assert got == half(2.0) + want
    assert dequant(ty.Q2_0, got)[:8] == [2.0, -2.0, 2.0, 0.0, -2.0, 0.0, 0.0, 0.0]


def test_q2_0_code_three_reads_as_plus_two():
    assert dequant(ty.Q2_0, half(0.5) + b"\xff" * 16) == [1.0] * 64


def test_mxfp4_exact_block():
    # amax 6 -> exponent floor(log2 6) - 2 + 127 = 127, scale 2^(127 - 128) = 0.5 applied to the doubled codes.
    x = [6.0, -6.0, 0.5, 0.24, 0.26, 1.25, -3.0, 2.5] + [0.0] * 24
    got = quant(ty.MXFP4, x)
    codes = [7, 15, 1, 0, 1, 2, 13, 4] + [0] * 24  # 1.25 ties 1.0 / 1.5 -> the first; 2.5 ties 2 / 3 -> 2
    assert got == bytes([127]) + bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    assert dequant(ty.MXFP4, got)[:8] == [6.0, -6.0, 0.5, 0.0, 0.5, 1.0, -3.0, 2.0]


def test_mxfp4_decoder_matches_layout_loop():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(5, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(100, 150, size=5)
    want = []
    for blk in raw:
        scale = 2.0 ** (int(blk[0]) - 127)
        vals = [0.0] * 32
        for j in range(16):
            vals[j] = E2M1[blk[1 + j] & 15] * scale
            vals[j + 16] = E2M1[blk[1 + j] >> 4] * scale
        want += vals
    assert dequant(ty.MXFP4, raw.tobytes()) == want


def ue4m3(byte: int) -> float:
    if byte in (0, 0x7F):
        return 0.0
    e, m = (byte >> 3) & 15, byte & 7
    return m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


def test_ue4m3_encoder_round_trips_every_code_and_rounds_halves_up():
    # Exponent 15 (codes 0x78..0x7E) is never produced: anything that reaches it encodes as 0x7E.
    codes = np.arange(1, 0x78, dtype=np.uint8)
    values = np.array([ue4m3(int(c)) for c in codes], dtype=np.float32)
    assert ty.f32_to_ue4m3(values).tolist() == codes.tolist()
    assert ty.f32_to_ue4m3(np.array([256.0, 300.0], np.float32)).tolist() == [0x7E, 0x7E]
    # Half-way between 1.0 (0x38) and 1.125 (0x39) rounds up; 448 and beyond clamp to 0x7E; non-positive to 0.
    assert ty.f32_to_ue4m3(np.array([1.0625, 1000.0, 0.0, -1.0], np.float32)).tolist() == [0x39, 0x7E, 0, 0]


def test_nvfp4_decoder_matches_layout_loop():
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, size=(3, 36), dtype=np.uint8)
    want = []
    for blk in raw:
        for s in range(4):
            d = ue4m3(int(blk[s]))
            sub = [0.0] * 16
            for j in range(8):
                q = blk[4 + 8 * s + j]
                sub[j], sub[j + 8] = E2M1[q & 15] * d, E2M1[q >> 4] * d
            want += sub
    assert dequant(ty.NVFP4, raw.tobytes()) == want


def test_nvfp4_exact_block():
    # Sub-block amax 6 -> scale byte for 1.0 (0x38), decoded 1.0 times the halved codes.
    x = [6.0, -3.0, 1.0, 0.0] + [0.0] * 12 + [0.0] * 48
    got = quant(ty.NVFP4, x)
    assert got[:4] == bytes([0x38, 0, 0, 0])
    assert got[4:6] == bytes([7 | (0 << 4), 13]) and dequant(ty.NVFP4, got)[:4] == [6.0, -3.0, 1.0, 0.0]


def trit_byte(digits: list[int]) -> int:
    v = 0
    for t in digits + [0] * (5 - len(digits)):
        v = v * 3 + t
    return (v * 256 + 242) // 243


def test_tq1_0_exact_block():
    x = np.zeros(256, np.float32)
    x[0], x[32], x[160], x[240], x[244] = 1.0, -1.0, 0.6, -0.4, 1.0  # d = 1
    got = quant(ty.TQ1_0, x)
    trits = (np.rint(x) + 1).astype(int)
    qs = [trit_byte([trits[m + 32 * n] for n in range(5)]) for m in range(32)]
    qs += [trit_byte([trits[160 + m + 16 * n] for n in range(5)]) for m in range(16)]
    qh = [trit_byte([trits[240 + j + 4 * n] for n in range(4)]) for j in range(4)]
    assert got == bytes(qs + qh) + half(1.0)
    assert dequant(ty.TQ1_0, got) == np.rint(x).tolist()


def test_tq2_0_exact_block():
    x = np.zeros(256, np.float32)
    x[0], x[32], x[127], x[128], x[255] = 2.0, -2.0, 1.0, -1.1, 1.0  # d = 2: codes round(x / 2) + 1
    got = quant(ty.TQ2_0, x)
    codes = (np.trunc(x / 2 + np.sign(x) * 0.5) + 1).astype(int)
    want = [sum(codes[128 * h + m + 32 * n] << (2 * n) for n in range(4)) for h in range(2) for m in range(32)]
    assert got == bytes(want) + half(2.0)
    assert dequant(ty.TQ2_0, got) == ((codes - 1) * 2.0).tolist()


def test_iq4_xs_decoder_matches_layout_loop():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(3, 136), dtype=np.uint8)
    raw[:, 1] = 0x2C  # keep d a small normal half
    want = []
    lv = ty.IQ4NL_LEVELS.tolist()
    for blk in raw:
        d = float(np.frombuffer(blk[0:2].tobytes(), "<f2")[0])
        sh = int(blk[2]) | int(blk[3]) << 8
        for ib in range(8):
            ls = ((int(blk[4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
            dl = np.float32(d) * np.float32(ls - 32)
            q = blk[8 + 16 * ib: 24 + 16 * ib]
            want += [float(dl * np.float32(lv[v & 15])) for v in q] + [float(dl * np.float32(lv[v >> 4])) for v in q]
    assert dequant(ty.IQ4_XS, raw.tobytes()) == want


def test_iq4_xs_zero_block_and_round_trip():
    assert dequant(ty.IQ4_XS, quant(ty.IQ4_XS, [0.0] * 256)) == [0.0] * 256
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    back = ty.through_type(ty.IQ4_XS, x)
    assert float(((back - x) ** 2).sum() / (x**2).sum()) < 1e-2


@pytest.mark.parametrize(("t", "max_nmse"), [(ty.Q2_0, 0.3), (ty.MXFP4, 3e-2), (ty.NVFP4, 2e-2), (ty.TQ1_0, 0.3),
                                             (ty.TQ2_0, 0.3), (ty.Q1_0, 0.5)])
def test_round_trip_error_is_bounded(t, max_nmse):
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (8, 2 * TYPES[t].blck)).astype(np.float32)
    back = ty.through_type(t, x)
    assert back.shape == x.shape
    assert float(((back - x) ** 2).sum() / (x**2).sum()) < max_nmse
    # Quantising what came back gives the same bytes: the formats are fixed points of their own quantiser's grid.
    assert np.array_equal(ty.dequantize(t, ty.quantize(t, back)), back)


def test_vec_dot_types_follow_the_cpu_type_traits():
    assert {t: ty.VEC_DOT_TYPE[t] for t in NEW_TYPES} == {
        ty.Q1_0: ty.Q8_0, ty.Q2_0: ty.Q8_0, ty.MXFP4: ty.Q8_0, ty.NVFP4: ty.Q8_0,
        ty.TQ1_0: ty.Q8_K, ty.TQ2_0: ty.Q8_K, ty.IQ4_XS: ty.Q8_K}


@pytest.fixture(scope="module")
def oracle(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


@pytest.mark.upstream
@pytest.mark.parametrize("t", (*NEW_TYPES, ty.Q8_0, ty.Q4_0, ty.Q4_1, ty.Q5_0, ty.Q5_1, ty.Q8_K))
def test_blocks_match_ggml_bit_for_bit(oracle, t):
    rng = np.random.default_rng(t)
    blck = TYPES[t].blck
    nb = 2048 if blck <= 64 else 512
    x = (rng.standard_normal(nb * blck) * rng.uniform(0.01, 3, nb * blck)).astype(np.float32)
    x[blck: 2 * blck] = rng.uniform(-1, 1, blck).round(1)  # many ties
    x[2 * blck: 3 * blck] = np.float32(1e-3) * rng.standard_normal(blck)
    ours = ty.quantize(t, x.reshape(1, -1)).reshape(nb, -1)
    assert np.array_equal(ours, oracle.from_float(t, x))
    if t != ty.Q8_K:  # Q8_K has no to_float: it is only ever an activation inside dot products
        assert np.array_equal(ty.dequantize(t, ours[None]).reshape(-1), oracle.to_float(t, ours))
        assert oracle.vec_dot_type(t) == ty.VEC_DOT_TYPE[t]
