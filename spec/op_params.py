"""What each ggml op keeps in ``rpc_tensor.op_params``: the 16 four-byte slots, slot by slot, as ggml's op constructors
write them and the CPU backend reads them.

``op_params`` is 64 bytes (16 x i32) at offset 56 of an rpc_tensor; a float parameter is stored as its IEEE-754 bits
in its slot, a flag as 0 or 1, a byte count or length as an i32.  Slots an op does not name are written 0 by ggml.
The table covers every op whose parameters the kit's reference executor reads (the ops of the conformance checks and
of the model zoo among them; ``tests/test_spec_op_params.py`` derives that list from the executor's source and
holds the table to it), and MUL_MAT, whose hint upstream's CPU backend reads; UNARY and GLU carry their sub-op in
slot 0 (:class:`~ggml_rpc.spec.enums.UnaryOp`, :class:`~ggml_rpc.spec.enums.GluOp`).  Facts from upstream ggml
(``ggml.c``'s constructors, ``ggml.h``'s enums, the CPU backend's reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from .enums import GgmlOp
from .tensor import GGML_MAX_OP_PARAMS

#: Four-byte slots in op_params.
OP_PARAM_SLOTS = GGML_MAX_OP_PARAMS // 4
I32, F32 = "i32", "f32"


@dataclass(frozen=True, slots=True)
class OpParam:
    """One parameter: ``count`` consecutive slots from ``slot``, each an ``i32`` or an ``f32`` (its bits)."""

    slot: int
    kind: str
    name: str
    doc: str
    count: int = 1

    @property
    def slots(self) -> range:
        return range(self.slot, self.slot + self.count)


def _i(slot: int, name: str, doc: str, count: int = 1) -> OpParam:
    return OpParam(slot, I32, name, doc, count)


def _f(slot: int, name: str, doc: str) -> OpParam:
    return OpParam(slot, F32, name, doc)


def _ints(names: str, doc: str) -> tuple[OpParam, ...]:
    """Consecutive i32 parameters from slot 0, one per name, each described by ``doc`` with ``{}`` = the name."""
    return tuple(_i(k, n, doc.format(n)) for k, n in enumerate(names.split()))


_WINDOW = (  # ACC and SET: a window of src1's shape inside the result, placed by byte strides
    _i(0, "nb1", "byte stride of the window's dimension 1 in the result"),
    _i(1, "nb2", "byte stride of the window's dimension 2"),
    _i(2, "nb3", "byte stride of the window's dimension 3"),
    _i(3, "offset", "byte offset of the window's first element in the result"),
    _i(4, "inplace", "1: the result is src0's memory (a view of it); 0: src0 is copied into the result first"),
)
_EPS = (_f(0, "eps", "added to the variance (or the norm) before dividing"),)
_CONV2D = _ints("s0 s1 p0 p1 d0 d1", "{} (stride, padding, dilation of dims 0 and 1)")
_ROPE = (
    _i(0, "n_past", "unused (0)"),
    _i(1, "n_dims", "number of rotated dimensions (even)"),
    _i(2, "mode", "0 normal, 2 NeoX, 8 M-RoPE, 24 vision, 40 iM-RoPE"),
    _i(3, "n_ctx", "unused (0)"),
    _i(4, "n_ctx_orig", "the context the model was trained on (YaRN)"),
    _f(5, "freq_base", "base of the rotation frequencies"),
    _f(6, "freq_scale", "frequency scale (context extension)"),
    _f(7, "ext_factor", "YaRN extrapolation mix; 0: none"),
    _f(8, "attn_factor", "magnitude scale of the rotated values"),
    _f(9, "beta_fast", "YaRN low correction dim"),
    _f(10, "beta_slow", "YaRN high correction dim"),
    _i(11, "sections", "M-RoPE: rotated dims per position stream (0 for the other modes)", count=4),
    _i(15, "n_offs", "first rotated dim; dims outside [n_offs, n_offs + n_dims) pass through"),
)
_SOFT_MAX = (
    _f(0, "scale", "multiplies the input before the softmax"),
    _f(1, "max_bias", "ALiBi maximum bias; 0: none"),
)

#: The op_params layout of each op whose parameters a server reads; slots not listed are 0.
OP_PARAMS: dict[int, tuple[OpParam, ...]] = {
    GgmlOp.ACC: _WINDOW,
    GgmlOp.ARANGE: (_f(0, "start", "first value"), _f(1, "stop", "end (exclusive)"), _f(2, "step", "increment")),
    GgmlOp.ARGSORT: (_i(0, "order", "0 ascending, 1 descending"),),
    GgmlOp.CLAMP: (_f(0, "min", "lower bound"), _f(1, "max", "upper bound")),
    GgmlOp.COL2IM_1D: (_i(0, "s0", "stride"), _i(1, "oc", "output channels"), _i(2, "p0", "padding")),
    GgmlOp.CONCAT: (_i(0, "dim", "the dimension (0..3) along which src1 follows src0"),),
    GgmlOp.CONV_2D: _CONV2D,
    GgmlOp.CONV_2D_DW: _CONV2D,
    GgmlOp.CONV_3D: (*_ints("s0 s1 s2 p0 p1 p2 d0 d1 d2", "{} (stride, padding, dilation of dims 0, 1, 2)"),
                     _i(9, "c", "input channels"), _i(10, "n", "batch size"), _i(11, "oc", "output channels")),
    GgmlOp.CONV_TRANSPOSE_1D: (_i(0, "s0", "stride"), _i(1, "p0", "padding"), _i(2, "d0", "dilation")),
    GgmlOp.CONV_TRANSPOSE_2D: (_i(0, "stride", "stride of both dimensions"),),
    GgmlOp.DIAG_MASK_INF: (_i(0, "n_past", "row i keeps columns 0 .. n_past + i, the later ones become -inf"),),
    GgmlOp.DSV4_HC_COMB: (_f(0, "eps", "added in each normalisation"),
                          _i(1, "n_iter", "normalisation rounds (Sinkhorn)")),
    GgmlOp.DSV4_HC_PRE: (_f(0, "scale", "gated form: the scale of the sum over streams (the weighted form writes 1)"),
                         _i(1, "gated", "1: sigmoid-gated form (src1 the gate), 0: weighted sum (src1 the weights)")),
    GgmlOp.FILL: (_f(0, "c", "the value every element gets"),),
    GgmlOp.FLASH_ATTN_EXT: (
        _f(0, "scale", "multiplies Q·K"),
        _f(1, "max_bias", "ALiBi maximum bias; 0: none"),
        _f(2, "logit_softcap", "soft cap of the scores; 0: none"),
        _i(3, "prec", "requested precision: 0 default or 10 F32; the CPU backend aborts the process on any other"),
        _i(4, "n_kv_max", "bound on the K/V rows used, set by the client (0: all); 6.0.0's CPU backend ignores it"),
    ),
    GgmlOp.GATED_DELTA_NET: (_i(0, "K", "state snapshots kept after the output (most recent first), at least 1"),),
    GgmlOp.GATED_LINEAR_ATTN: (_f(0, "scale", "multiplies the output"),),
    GgmlOp.GLU: (
        _i(0, "op", "the GLU sub-op (the GLU ops table)"),
        _i(1, "swapped", "with one source: 1 if the activated half is the second one, 0 if it is the first"),
        _f(2, "alpha", "SWIGLU_OAI: the sigmoid's slope"),
        _f(3, "limit", "SWIGLU_OAI and SWIGLU_CLAMP: the clamp limit"),
    ),
    GgmlOp.GROUP_NORM: (_i(0, "n_groups", "number of groups"), _f(1, "eps", "added to the variance")),
    GgmlOp.IM2COL: (*_CONV2D, _i(6, "is_2D", "1: a 2-D convolution's columns, 0: 1-D")),
    GgmlOp.IM2COL_3D: (*_ints("s0 s1 s2 p0 p1 p2 d0 d1 d2", "{} (stride, padding, dilation of dims 0, 1, 2)"),
                       _i(9, "IC", "input channels")),
    GgmlOp.L2_NORM: _EPS,
    GgmlOp.LEAKY_RELU: (_f(0, "negative_slope", "slope for negative inputs"),),
    GgmlOp.MUL_MAT: (
        _i(0, "prec", "requested precision (0 default, 10 F32); the CPU backend ignores it"),
        _i(1, "hint", "1: src0 is a Hadamard matrix, and the CPU backend applies the fast Walsh-Hadamard transform "
                      "to src1 instead of multiplying; 0: none"),
    ),
    GgmlOp.NORM: _EPS,
    GgmlOp.PAD: (*_ints("lp0 rp0 lp1 rp1 lp2 rp2 lp3 rp3", "{} (padding before / after, dims 0 to 3)"),
                 _i(8, "circular", "1: wrap around instead of zeros")),
    GgmlOp.PAD_REFLECT_1D: (_i(0, "p0", "reflected padding before"), _i(1, "p1", "reflected padding after")),
    GgmlOp.POOL_1D: (_i(0, "op", "0 max, 1 average"), _i(1, "k0", "kernel size"), _i(2, "s0", "stride"),
                     _i(3, "p0", "padding")),
    GgmlOp.POOL_2D: (_i(0, "op", "0 max, 1 average"), *(_i(k + 1, n, f"{n} (kernel, stride, padding of dims 0, 1)")
                                                         for k, n in enumerate("k0 k1 s0 s1 p0 p1".split()))),
    GgmlOp.RMS_NORM: _EPS,
    GgmlOp.RMS_NORM_BACK: _EPS,
    GgmlOp.ROLL: _ints("shift0 shift1 shift2 shift3", "{} (elements each dimension is rotated by)"),
    GgmlOp.ROPE: _ROPE,
    GgmlOp.ROPE_BACK: _ROPE,
    GgmlOp.SCALE: (_f(0, "s", "the factor"), _f(1, "b", "added after scaling")),
    GgmlOp.SET: _WINDOW,
    GgmlOp.SOFT_MAX: _SOFT_MAX,
    GgmlOp.SOFT_MAX_BACK: _SOFT_MAX,
    GgmlOp.SSM_SCAN: (_i(0, "K", "state snapshots kept after the output (most recent first), at least 1"),),
    GgmlOp.TIMESTEP_EMBEDDING: (_i(0, "dim", "embedding width"), _i(1, "max_period", "longest period")),
    GgmlOp.TRI: (_i(0, "type", "0 upper with diagonal, 1 upper, 2 lower with diagonal, 3 lower"),),
    GgmlOp.UNARY: (
        _i(0, "op", "the unary sub-op (the unary ops table)"),
        _f(1, "alpha_n", "XIELU: the negative branch's factor (beta + softplus of the model's alpha_n)"),
        _f(2, "alpha_p", "XIELU: the positive branch's factor (softplus of the model's alpha_p)"),
        _f(3, "beta", "XIELU: the linear term"),
        _f(4, "eps", "XIELU: where the negative branch's exponential is clipped"),
    ),
    GgmlOp.UPSCALE: (_i(0, "mode", "0 nearest, 1 bilinear, 2 bicubic; + 256: align corners, + 512: antialias"),),
}

#: Where a layout is newer than the oldest covered build: slots the older build's constructor leaves 0.
OP_PARAMS_SINCE: dict[int, str] = {
    GgmlOp.DSV4_HC_PRE: "the gated form (slots 0 and 1) came with ggml 0.25.0, in 7.0.0's and 8.0.0's builds; 6.0.0's "
                        "has only the weighted sum, both slots 0",
}

#: Ops whose op_params the CPU backend of the covered builds also reads, left out of :data:`OP_PARAMS` because the
#: kit computes none of them (its executor refuses them), or because they hold native function pointers.
READ_NOT_LISTED: tuple[int, ...] = (
    GgmlOp.IM2COL_BACK, GgmlOp.POOL_2D_BACK, GgmlOp.WIN_PART, GgmlOp.WIN_UNPART, GgmlOp.ADD_REL_POS,
    GgmlOp.FLASH_ATTN_BACK, GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2, GgmlOp.MAP_CUSTOM3, GgmlOp.CUSTOM,
)

#: Ops whose op_params ggml writes but no server reads: a view's description is in its rpc_tensor fields.
WRITTEN_NOT_READ: dict[int, str] = {
    GgmlOp.VIEW: "the view's byte offset (also in `view_offs`, which is what counts)",
    GgmlOp.PERMUTE: "the permuted axes (the view's `ne` and `nb` say it)",
}


def _check() -> None:
    for op, params in OP_PARAMS.items():
        used: set[int] = set()
        for p in params:
            if p.kind not in (I32, F32) or not set(p.slots) <= set(range(OP_PARAM_SLOTS)) or used & set(p.slots):
                raise AssertionError(f"op_params of {GgmlOp(op).name}: bad or overlapping slot {p.slot}")
            used |= set(p.slots)


_check()
