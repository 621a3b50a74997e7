"""What one block of each quantised ggml type holds, field by field (ggml-common.h's block structs, as data).

Tensor data is not parsed by the protocol, but every byte of it is a sequence of these blocks: the reference
executor slices its numpy block arrays by the offsets derived here (:func:`block_fields`), the docs list them, and a
test holds each layout's size to the type table's ``size``.  Scales named ``d`` are the block's delta, ``m``/``dmin``
its minimum; ``qs`` the packed codes, ``qh`` their high bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import numpy as np
from construct import Array, Bytes, Float16l, Float32l, Int8sl, Int8ul, Int16sl, Int16ul, Struct

from .enums import TYPES, GgmlType

QK_K = 256  # elements of a K-quant (and i-quant) super-block


def _f16(doc: str) -> object:
    return Float16l * doc


#: Block layout per quantised type id.
BLOCKS: Mapping[int, Struct] = {
    GgmlType.Q4_0: Struct("d" / _f16("scale"), "qs" / Bytes(16) * "32 4-bit codes: low nibbles first, then high"),
    GgmlType.Q4_1: Struct("d" / _f16("scale"), "m" / _f16("minimum"), "qs" / Bytes(16) * "32 4-bit codes"),
    GgmlType.Q5_0: Struct("d" / _f16("scale"), "qh" / Bytes(4) * "the 5th bit of each of the 32 codes",
                          "qs" / Bytes(16) * "low 4 bits of the codes"),
    GgmlType.Q5_1: Struct("d" / _f16("scale"), "m" / _f16("minimum"), "qh" / Bytes(4) * "5th bits",
                          "qs" / Bytes(16) * "low 4 bits"),
    GgmlType.Q8_0: Struct("d" / _f16("scale"), "qs" / Array(32, Int8sl) * "32 signed 8-bit codes"),
    GgmlType.Q8_1: Struct("d" / _f16("scale"), "s" / _f16("scale times the sum of the codes"),
                          "qs" / Array(32, Int8sl) * "32 signed 8-bit codes"),
    GgmlType.Q2_K: Struct("scales" / Bytes(QK_K // 16) * "4-bit scale and 4-bit minimum of each 16 elements",
                          "qs" / Bytes(QK_K // 4) * "2-bit codes", "d" / _f16("super-block scale of the scales"),
                          "dmin" / _f16("super-block scale of the minimums")),
    GgmlType.Q3_K: Struct("hmask" / Bytes(QK_K // 8) * "high bit of each code", "qs" / Bytes(QK_K // 4) * "low 2 bits",
                          "scales" / Bytes(12) * "16 6-bit scales", "d" / _f16("super-block scale")),
    GgmlType.Q4_K: Struct("d" / _f16("super-block scale of the scales"),
                          "dmin" / _f16("super-block scale of the minimums"),
                          "scales" / Bytes(12) * "8 6-bit scales and 8 6-bit minimums",
                          "qs" / Bytes(QK_K // 2) * "4-bit codes"),
    GgmlType.Q5_K: Struct("d" / _f16("super-block scale of the scales"),
                          "dmin" / _f16("super-block scale of the minimums"),
                          "scales" / Bytes(12) * "8 6-bit scales and minimums", "qh" / Bytes(QK_K // 8) * "5th bits",
                          "qs" / Bytes(QK_K // 2) * "low 4 bits"),
    GgmlType.Q6_K: Struct("ql" / Bytes(QK_K // 2) * "low 4 bits", "qh" / Bytes(QK_K // 4) * "high 2 bits",
                          "scales" / Array(QK_K // 16, Int8sl) * "signed 8-bit scales",
                          "d" / _f16("super-block scale")),
    GgmlType.Q8_K: Struct("d" / Float32l * "scale (float32)", "qs" / Array(QK_K, Int8sl) * "signed 8-bit codes",
                          "bsums" / Array(QK_K // 16, Int16sl) * "sum of each 16 codes"),
    GgmlType.IQ2_XXS: Struct("d" / _f16("scale"), "qs" / Array(QK_K // 8, Int16ul) * "grid indices, signs, scales"),
    GgmlType.IQ2_XS: Struct("d" / _f16("scale"), "qs" / Array(QK_K // 8, Int16ul) * "grid indices and signs",
                            "scales" / Bytes(QK_K // 32) * "4-bit scales"),
    GgmlType.IQ3_XXS: Struct("d" / _f16("scale"), "qs" / Bytes(3 * QK_K // 8) * "grid indices, signs and scales"),
    GgmlType.IQ1_S: Struct("d" / _f16("scale"), "qs" / Bytes(QK_K // 8) * "low 8 bits of the grid indices",
                           "qh" / Array(QK_K // 32, Int16ul) * "high index bits, scale and delta sign"),
    GgmlType.IQ4_NL: Struct("d" / _f16("scale"), "qs" / Bytes(16) * "32 4-bit indices into the non-linear levels"),
    GgmlType.IQ3_S: Struct("d" / _f16("scale"), "qs" / Bytes(QK_K // 4) * "low 8 bits of the grid indices",
                           "qh" / Bytes(QK_K // 32) * "9th index bits", "signs" / Bytes(QK_K // 8) * "signs",
                           "scales" / Bytes(QK_K // 64) * "4-bit scales"),
    GgmlType.IQ2_S: Struct("d" / _f16("scale"), "qs" / Bytes(QK_K // 4) * "grid indices then signs",
                           "qh" / Bytes(QK_K // 32) * "high index bits", "scales" / Bytes(QK_K // 32) * "4-bit scales"),
    GgmlType.IQ4_XS: Struct("d" / _f16("super-block scale"), "scales_h" / Int16ul * "high 2 bits of the 8 scales",
                            "scales_l" / Bytes(QK_K // 64) * "low 4 bits of the 8 scales",
                            "qs" / Bytes(QK_K // 2) * "4-bit indices into the non-linear levels"),
    GgmlType.IQ1_M: Struct("qs" / Bytes(QK_K // 8) * "low 8 bits of the grid indices",
                           "qh" / Bytes(QK_K // 16) * "high index bits and delta signs",
                           "scales" / Bytes(QK_K // 32) * "3-bit scales, the f16 super-block scale spread over them"),
    GgmlType.TQ1_0: Struct("qs" / Bytes((QK_K - 4 * QK_K // 64) // 5) * "5 ternary codes per byte",
                           "qh" / Bytes(QK_K // 64) * "4 ternary codes per byte", "d" / _f16("scale")),
    GgmlType.TQ2_0: Struct("qs" / Bytes(QK_K // 4) * "2-bit ternary codes", "d" / _f16("scale")),
    GgmlType.MXFP4: Struct("e" / Int8ul * "E8M0 scale (a power of two)", "qs" / Bytes(16) * "32 E2M1 4-bit codes"),
    GgmlType.NVFP4: Struct("d" / Bytes(4) * "UE4M3 scale of each 16 elements", "qs" / Bytes(32) * "64 E2M1 codes"),
    GgmlType.Q1_0: Struct("d" / _f16("scale"), "qs" / Bytes(16) * "128 sign bits, least significant first"),
    GgmlType.Q2_0: Struct("d" / _f16("scale"), "qs" / Bytes(16) * "64 2-bit codes, least significant first"),
}


@dataclass(frozen=True)
class Field:
    """One field of a block: its byte range and width."""

    name: str
    start: int
    stop: int
    doc: str = ""

    @property
    def span(self) -> slice:
        return slice(self.start, self.stop)


@cache
def block_fields(type_id: int) -> dict[str, slice]:
    """Byte range of every field of one block of ``type_id``, by field name (``b[:, f["qs"]]`` on blocks (n, size))."""
    return {f.name: f.span for f in block_layout(type_id)}


@cache
def block_layout(type_id: int) -> tuple[Field, ...]:
    """The fields of one block of ``type_id`` in order, with their byte ranges."""
    struct = BLOCKS.get(type_id)
    if struct is None:
        raise KeyError(f"type {TYPES[type_id].name if type_id in TYPES else type_id} has no block layout")
    out, at = [], 0
    for sub in struct.subcons:
        width = sub.sizeof()
        out.append(Field(sub.name, at, at + width, getattr(sub, "docs", "") or ""))
        at += width
    return tuple(out)


#: :func:`block_fields` of every type with a layout, by type id.
BLOCK_FIELDS: Mapping[int, dict[str, slice]] = {int(t): block_fields(t) for t in BLOCKS}


def pack_blocks(type_id: int, n: int, **fields: np.ndarray) -> np.ndarray:
    """``n`` blocks of ``type_id`` as uint8 (n, size), each field of its layout written from ``fields``, which must
    name every field (uint8 arrays of the field's width, or arrays broadcasting to it)."""
    layout = BLOCK_FIELDS[type_id]
    if fields.keys() != layout.keys():
        raise ValueError(f"{TYPES[type_id].name} blocks have fields {list(layout)}, not {list(fields)}")
    out = np.empty((n, TYPES[type_id].size), dtype=np.uint8)
    for name, value in fields.items():
        out[:, layout[name]] = value
    return out
