"""Enumerations of the ggml RPC protocol and of ggml itself, kept as data.

Everything a schema, a server or a dissector needs to name a number lives here: command ids, ggml types with
their block geometry, the 101 graph ops, the UNARY and GLU sub-ops carried in ``op_params[0]`` and the tensor
flags.  The tables are the single place these facts are written down, with the one word for which way a message travels
(:class:`Direction`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Command(enum.IntEnum):
    """A command's identity.  Its wire id (the first byte of a request) belongs to a protocol version:
    :meth:`ggml_rpc.spec.versions.Protocol.wire_id` and :meth:`~ggml_rpc.spec.versions.Protocol.command_at`.

    Members up to GET_DEVICE_SUPPORTS_OP carry the id they have on the wire in 6.0.0 to 7.0.1 (HELLO is 14 in every
    version).  8.0.0 gives ids 18 and 19 to new commands (and moves the NONE sentinel to 23), so the commands it adds
    carry ``0x100 + id``: a value no byte can hold, which nothing can send without asking the version for its id.
    """

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    NONE = 18
    GET_DEVICE_SUPPORTS_OP = 19
    SET_TENSOR_2D = 0x100 + 18
    GET_TENSOR_2D = 0x100 + 19
    COMM_INIT = 0x100 + 20
    COMM_ALLREDUCE = 0x100 + 21
    COMM_FREE = 0x100 + 22


#: Command ids that exist in the enum but are a client-side sentinel: a server closes when it sees one.
NEVER_ON_WIRE: frozenset[Command] = frozenset({Command.NONE})


class Direction(enum.StrEnum):
    """Which way bytes travel on a connection: requests from the client to the server, replies back.  The value is
    how every report writes it (text, JSON)."""

    C2S = "client->server"
    S2C = "server->client"

    @classmethod
    def of(cls, from_client: bool) -> Direction:
        return cls.C2S if from_client else cls.S2C


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """Geometry of one ggml type: ``blck`` elements are stored in ``size`` bytes (``blck == 0``: removed)."""

    id: int
    name: str
    blck: int
    size: int

    @property
    def removed(self) -> bool:
        return self.blck == 0

    @property
    def quantized(self) -> bool:
        return self.blck > 1


_TYPE_ROWS: tuple[tuple[int, str, int, int], ...] = (
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (4, "REMOVED_Q4_2", 0, 0),
    (5, "REMOVED_Q4_3", 0, 0),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (31, "REMOVED_Q4_0_4_4", 0, 0),
    (32, "REMOVED_Q4_0_4_8", 0, 0),
    (33, "REMOVED_Q4_0_8_8", 0, 0),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (36, "REMOVED_IQ4_NL_4_4", 0, 0),
    (37, "REMOVED_IQ4_NL_4_8", 0, 0),
    (38, "REMOVED_IQ4_NL_8_8", 0, 0),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
    (42, "Q2_0", 64, 18),
)

#: ggml type id -> geometry, for every id below GGML_TYPE_COUNT.
TYPES: dict[int, TypeInfo] = {row[0]: TypeInfo(*row) for row in _TYPE_ROWS}
GGML_TYPE_COUNT = len(TYPES)

GgmlType = enum.IntEnum("GgmlType", [(t.name, t.id) for t in TYPES.values()])  # type: ignore[misc]
GgmlType.__doc__ = "ggml_type as carried in rpc_tensor.type (removed ids keep a REMOVED_ name)."

_OP_NAMES = (
    "NONE DUP ADD ADD_ID ADD1 ACC SUB MUL DIV SQR SQRT LOG SIN COS SUM SUM_ROWS CUMSUM MEAN ARGMAX COUNT_EQUAL "
    "REPEAT REPEAT_BACK CONCAT SILU_BACK NORM RMS_NORM RMS_NORM_BACK GROUP_NORM L2_NORM MUL_MAT MUL_MAT_ID OUT_PROD "
    "SCALE SET CPY CONT RESHAPE VIEW PERMUTE TRANSPOSE GET_ROWS GET_ROWS_BACK SET_ROWS DIAG DIAG_MASK_INF "
    "DIAG_MASK_ZERO SOFT_MAX SOFT_MAX_BACK ROPE ROPE_BACK CLAMP CONV_TRANSPOSE_1D IM2COL IM2COL_BACK IM2COL_3D "
    "COL2IM_1D CONV_2D CONV_3D CONV_2D_DW CONV_TRANSPOSE_2D POOL_1D POOL_2D POOL_2D_BACK UPSCALE PAD PAD_REFLECT_1D "
    "ROLL ARANGE TIMESTEP_EMBEDDING ARGSORT TOP_K LEAKY_RELU TRI FILL FLASH_ATTN_EXT FLASH_ATTN_BACK SSM_CONV "
    "SSM_SCAN WIN_PART WIN_UNPART GET_REL_POS ADD_REL_POS RWKV_WKV6 GATED_LINEAR_ATTN RWKV_WKV7 SOLVE_TRI "
    "GATED_DELTA_NET LIGHTNING_INDEXER DSV4_HC_COMB DSV4_HC_PRE DSV4_HC_POST UNARY MAP_CUSTOM1 MAP_CUSTOM2 "
    "MAP_CUSTOM3 CUSTOM CROSS_ENTROPY_LOSS CROSS_ENTROPY_LOSS_BACK OPT_STEP_ADAMW OPT_STEP_SGD GLU"
).split()

GgmlOp = enum.IntEnum("GgmlOp", [(name, i) for i, name in enumerate(_OP_NAMES)])  # type: ignore[misc]
GgmlOp.__doc__ = "ggml_op as carried in rpc_tensor.op (numbering of protocol 6.0.0 / 7.0.0)."
GGML_OP_COUNT = len(_OP_NAMES)

#: Ops whose op_params hold native function pointers: never executed by anything safe.
NATIVE_CALLBACK_OPS: frozenset[int] = frozenset(
    {GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2, GgmlOp.MAP_CUSTOM3, GgmlOp.CUSTOM}  # type: ignore[attr-defined]
)

#: Ops that only describe memory another tensor owns (views and the leaf op NONE): a node of one computes nothing.
EMPTY_OPS: frozenset[int] = frozenset(
    {GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.TRANSPOSE, GgmlOp.VIEW, GgmlOp.PERMUTE}  # type: ignore[attr-defined]
)

UnaryOp = enum.IntEnum(  # type: ignore[misc]
    "UnaryOp",
    [
        (name, i)
        for i, name in enumerate(
            "ABS SGN NEG STEP TANH ELU RELU SIGMOID GELU GELU_QUICK SILU HARDSWISH HARDSIGMOID EXP EXPM1 SOFTPLUS "
            "GELU_ERF XIELU FLOOR CEIL ROUND TRUNC".split()
        )
    ],
)
UnaryOp.__doc__ = "Sub-op of GGML_OP_UNARY, carried in op_params[0]."

GluOp = enum.IntEnum(  # type: ignore[misc]
    "GluOp",
    [(name, i) for i, name in enumerate("REGLU GEGLU SWIGLU SWIGLU_OAI GEGLU_ERF GEGLU_QUICK SWIGLU_CLAMP".split())],
)
GluOp.__doc__ = "Sub-op of GGML_OP_GLU, carried in op_params[0]."


class TensorFlag(enum.IntFlag):
    """ggml tensor flags as carried in rpc_tensor.flags."""

    INPUT = 1
    OUTPUT = 2
    PARAM = 4
    LOSS = 8
    COMPUTE = 16


def type_name(type_id: int) -> str:
    """Name of a ggml type id, or ``TYPE_<n>`` for ids outside the table."""
    info = TYPES.get(type_id)
    return info.name if info else f"TYPE_{type_id}"


def op_name(op_id: int) -> str:
    """Name of a ggml op id, or ``OP_<n>`` for ids outside the table."""
    return _OP_NAMES[op_id] if 0 <= op_id < GGML_OP_COUNT else f"OP_{op_id}"


def command_name(cmd: int) -> str:
    """Name of a command (a :class:`Command`, or a wire id of 6.0.0-7.0.1), or ``CMD_<n>`` for ids no version
    defines.  A wire id of another version is named by that version: :meth:`Protocol.command_name`."""
    if isinstance(cmd, Command):
        return cmd.name
    try:
        return Command(cmd).name
    except ValueError:
        return f"CMD_{cmd}"
