"""MUL_MAT of the types dotted with 8-bit activations, in upstream's own arithmetic: bit for bit against ggml's
``ggml_vec_dot_*`` called in the installed build (the one-token kernel), and the batch form (tinyBLAS's: one
accumulator for IQ4_NL too) against a plain loop of the same arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.upstream.ggml_lib import GgmlLibrary
from ggml_rpc.reference.executor import lowbit_dot, q8dot
from ggml_rpc.reference.executor.dequant import _q5_values, e8m0_half
from ggml_rpc.reference.executor.formats import E2M1_DOUBLED, IQ4NL_LEVELS, LAYOUT, half_field, low_high
from ggml_rpc.reference.executor.lowbit_dot import LOWBIT_TYPES
from ggml_rpc.reference.executor.types import IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, VEC_DOT_TYPE
from ggml_rpc.spec import TYPES

F = np.float32
TYPES_DOTTED = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4)


def _numpy_codes(type_id: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks ``(m, nb, size)`` to (codes int8 ``(m, nb * 32)``, scale float32 ``(m, nb)``, min ``(m, nb)`` or
    None), decoded in numpy independently of the compiled decoder the kernel's packed form comes from: the codes as
    the kernel multiplies them (signed for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, unsigned below 32 for
    Q4_1/Q5_1)."""
    m, nb, size = blocks.shape
    flat = np.ascontiguousarray(blocks).reshape(m * nb, size)
    f = LAYOUT[type_id]
    if type_id == Q4_0:
        q = low_high(flat[:, f["qs"]]).astype(np.int8) - np.int8(8)
    elif type_id == Q5_0:
        q = _q5_values(flat[:, f["qh"]], flat[:, f["qs"]]).astype(np.int8) - np.int8(16)
    elif type_id == Q8_0:
        q = flat[:, f["qs"]].view(np.int8)
    elif type_id == IQ4_NL:
        q = IQ4NL_LEVELS[low_high(flat[:, f["qs"]])]
    elif type_id == MXFP4:
        q = E2M1_DOUBLED[low_high(flat[:, f["qs"]])]
    elif type_id == Q4_1:
        q = low_high(flat[:, f["qs"]])
    elif type_id == Q5_1:
        q = _q5_values(flat[:, f["qh"]], flat[:, f["qs"]])
    else:
        raise ValueError(f"type {type_id} is not dotted with 8-bit activations")
    codes = q.astype(np.int8).reshape(m, nb * 32)
    # MXFP4's scale is an E8M0 exponent, halved to pair with the doubled E2M1 codes (as ggml's table holds them).
    d = (e8m0_half(flat[:, f["e"]]) if type_id == MXFP4 else half_field(flat, f["d"])).reshape(m, nb)
    mins = half_field(flat, f["m"]).reshape(m, nb) if "m" in f else None
    return codes, d.astype(np.float32), mins



@pytest.fixture(scope="module")
def lib(upstream_peer) -> GgmlLibrary:
    return GgmlLibrary(upstream_peer.test_backend_ops.parent)


def _loop(type_id: int, blocks: np.ndarray, x: np.ndarray, two: bool) -> np.ndarray:
    """One output at a time: lanes of four products, FMAs block by block (into two accumulators alternately when
    ``two``), the pairwise lane sum, the odd block and the Q8_1 sum term in float32; the codes decoded by numpy
    (the packed form's by the compiled decoder)."""
    wc, wd, wm = _numpy_codes(type_id, blocks)
    ac, ad, as_ = q8dot.activation_codes(x, q8dot.EXACT_TYPES[type_id])
    m, nb = wd.shape
    wc = wc.astype(F).reshape(m, nb * 8, 4)
    ac = ac.astype(F).reshape(x.shape[0], nb * 8, 4)
    out = np.zeros((x.shape[0], m), F)
    for r in range(x.shape[0]):
        for c in range(m):
            accs = [np.zeros(8, F), np.zeros(8, F)]
            last = nb - nb % 2 if two else nb
            for b in range(last):
                lanes = (wc[c, b * 8 : b * 8 + 8] * ac[r, b * 8 : b * 8 + 8]).sum(axis=1)
                d = F(wd[c, b] * ad[r, b])
                acc = accs[b % 2 if two else 0]
                acc[:] = (np.float64(d) * lanes + acc).astype(F)
            v = accs[0] + accs[1] if two else accs[0]
            t = v[4:] + v[:4]
            total = F((t[0] + t[2]) + (t[1] + t[3]))
            for b in range(last, nb):  # fused: sumf += d * isum
                isum = (wc[c, b * 8 : b * 8 + 8] * ac[r, b * 8 : b * 8 + 8]).sum()
                total = F(np.float64(F(wd[c, b] * ad[r, b])) * np.float64(isum) + np.float64(total))
            if q8dot.EXACT_TYPES[type_id]:
                summs = F(0)
                for b in range(nb):
                    summs = F(summs + F(wm[c, b] * as_[r, b]))
                total = F(total + summs)
            out[r, c] = total
    return out


def _weights(lib: GgmlLibrary | None, type_id: int, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    from ggml_rpc.reference.executor.types import quantize

    w = (rng.standard_normal((m, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
    blocks = lib.from_float(type_id, w) if lib is not None else quantize(type_id, w.reshape(-1, k))
    return np.asarray(blocks, dtype=np.uint8).reshape(m, k // 32, TYPES[type_id].size)


@pytest.mark.parametrize("type_id", TYPES_DOTTED)
@pytest.mark.parametrize("k", [32, 96, 256, 288])
def test_batch_and_token_forms_are_the_loop(type_id: int, k: int) -> None:
    rng = np.random.default_rng(k + type_id)
    blocks = _weights(None, type_id, 5, k, rng)
    packed = q8dot.pack_weights(type_id, blocks)
    x = (rng.standard_normal((3, k)) * 4).astype(F)
    batch_two = type_id == MXFP4  # no tinyBLAS for MXFP4: its batch is the one-token kernel's
    assert q8dot.products(type_id, packed, x, 5, batch=True).tobytes() == _loop(type_id, blocks, x, batch_two).tobytes()
    one = q8dot.products(type_id, packed, x[:1], 5, batch=False)
    assert one.tobytes() == _loop(type_id, blocks, x[:1], type_id in (IQ4_NL, MXFP4)).tobytes()


@pytest.mark.parametrize("type_id", TYPES_DOTTED)
@pytest.mark.parametrize("k", [32, 96, 256, 288])
def test_raw_block_products_are_the_packed_ones(type_id: int, k: int) -> None:
    # The form for weights the cache does not keep: the same bits from the blocks as stored, batch and one token.
    rng = np.random.default_rng(10 * k + type_id)
    blocks = _weights(None, type_id, 7, k, rng)
    packed = q8dot.pack_weights(type_id, blocks)
    x = (rng.standard_normal((7, k)) * 3).astype(F)  # four rows at a time, then three one by one
    for rows, batch in ((x, True), (x[:4], True), (x[:1], False)):
        want = q8dot.products(type_id, packed, rows, 7, batch=batch)
        assert q8dot.raw_products(type_id, blocks, rows, batch=batch).tobytes() == want.tobytes()


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", TYPES_DOTTED)
def test_one_token_product_is_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    vt = VEC_DOT_TYPE[type_id]
    assert lib.vec_dot_type(type_id) == vt
    for k in (32, 64, 96, 256, 288, 4096):
        blocks = _weights(lib, type_id, 16, k, rng)
        x = (rng.standard_normal((1, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        got = q8dot.products(type_id, q8dot.pack_weights(type_id, blocks), x, 16, batch=False)[0]
        act = lib.from_float(vt, x)
        want = np.array([lib.vec_dot(type_id, blocks[i], act) for i in range(16)], dtype=F)
        assert got.tobytes() == want.tobytes(), (TYPES[type_id].name, k, np.abs(got - want).max())
        raw = q8dot.raw_products(type_id, blocks, x, batch=False)[0]
        assert raw.tobytes() == want.tobytes(), (TYPES[type_id].name, k, "raw blocks")


@pytest.mark.upstream
@pytest.mark.parametrize("type_id", sorted(LOWBIT_TYPES))
def test_low_bit_products_are_ggmls_vec_dot_bit_for_bit(lib: GgmlLibrary, type_id: int) -> None:
    rng = np.random.default_rng(type_id)
    assert lib.vec_dot_type(type_id) == Q8_0
    for k in (128, 256, 640, 4096):
        w = (rng.standard_normal((16, k)) * rng.choice([0.02, 1.0, 30.0])).astype(F)
        blocks = lib.from_float(type_id, w).reshape(16, k // TYPES[type_id].blck, TYPES[type_id].size)
        x = (rng.standard_normal((1, k)) * rng.choice([0.01, 1.0, 50.0])).astype(F)
        got = lowbit_dot.products(type_id, lowbit_dot.pack_weights(type_id, blocks), x)[0]
        act = lib.from_float(Q8_0, x)
        want = np.array([lib.vec_dot(type_id, blocks[i], act) for i in range(16)], dtype=F)
        assert got.tobytes() == want.tobytes(), (TYPES[type_id].name, k, np.abs(got - want).max())


def test_compiled_half_decoding_is_numpys_for_every_pattern() -> None:
    from ggml_rpc.reference.executor.compiled import _half

    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(F)
    got = np.array([_half(int(b) & 0xFF, int(b) >> 8) for b in bits], dtype=F)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert got[~nan].tobytes() == want[~nan].tobytes()  # zeros' signs, subnormals and infinities included


def test_scales_past_the_normal_range_are_read_as_ggml_reads_them() -> None:
    # Q8_0 blocks with subnormal, infinite and negative-zero fp16 scales: the compiled decoder reads the scale from
    # the block, the loop from numpy's decoding.
    rng = np.random.default_rng(7)
    blocks = np.zeros((4, 2, TYPES[Q8_0].size), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, (4, 2, 32), dtype=np.uint8)
    for i, scale in enumerate([np.float16(6e-8), np.float16(3e-5), np.float16(-0.0), np.float16(np.inf)]):
        blocks[i, :, :2] = np.frombuffer(scale.tobytes(), np.uint8)
    x = (rng.standard_normal((1, 64)) * 4).astype(F)
    got = q8dot.products(Q8_0, q8dot.pack_weights(Q8_0, blocks), x, 4, batch=False)
    with np.errstate(invalid="ignore", over="ignore"):  # infinity times a zero lane
        want = _loop(Q8_0, blocks, x, False)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("summed", [False, True])
def test_compiled_activation_codes_are_numpys_in_lane_order(summed: bool) -> None:
    r = np.random.default_rng(int(summed))
    x = (r.standard_normal((40, 256)) * 10.0 ** r.integers(-6, 6, (40, 1))).astype(F)
    x[0] = 0.0  # a zero block: scale 0, codes 0
    x[1, :32] = np.arange(32, dtype=F) - 15.5  # products of exact halves: ties rounded to even
    x[2, :32] = np.float32(127) * np.arange(32, dtype=F) / 2  # codes landing on .5
    x[3, :32] = F(65504) * 4  # a scale beyond F16's range
    got = q8dot.lane_codes(x, summed)
    with np.errstate(over="ignore"):  # the block sum of row 3 overflows F16: infinite in both forms
        ac, ad, as_ = q8dot.activation_codes(x, summed)
    want = (q8dot.in_lane_order(ac), ad, as_)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()
    x[5, 7] = np.nan  # not finite: numpy's own form, whatever it gives
    x[6, 3] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        got = q8dot.lane_codes(x, summed)
        ac, ad, as_ = q8dot.activation_codes(x, summed)
    assert got[0].tobytes() == q8dot.in_lane_order(ac).tobytes()
