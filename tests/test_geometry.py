"""The tensor geometry generator (``spec.geometry``): every class it draws is the class its tensor is found to be,
drawn in-buffer places lie inside their buffer, and the out-of-buffer ones outside it."""

from __future__ import annotations

import pytest
from ggml_rpc.spec import TYPES, GgmlType, ggml_nbytes
from ggml_rpc.spec.geometry import (
    DIMS,
    IN_BUFFER,
    NB_MODULUS,
    ORDINARY_SHAPES,
    PLACES,
    SHAPES,
    VIEWS,
    Seeded,
    Span,
    classify,
    draw_geometry,
    shape_class,
    view_of,
)

SPAN = Span(0x1111, 0x7F00_0000_0000, 4096)
OTHER = Span(0x2222, 0x7F00_0001_0000, 512)
FREED = Span(0x3333, 0x7F00_0002_0000, 256)


def test_the_dimensions_and_stride_width_come_from_the_schema() -> None:
    assert DIMS == 4 and NB_MODULUS == 1 << 32
    assert {f"empty-{k}" for k in range(DIMS)} <= set(SHAPES)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("where", PLACES)
def test_every_drawn_class_is_the_class_found(shape: str, where: str) -> None:
    c = Seeded(hash((shape, where)) & 0xFFFF)
    for i in range(8):
        g = draw_geometry(c, SPAN, id=i + 1, shape=shape, where=where, others=[OTHER], freed=[FREED])
        f = g.fields
        assert g.nbytes == ggml_nbytes(f["type"], f["ne"], f["nb"])
        found = classify(f, SPAN if f["buffer"] == SPAN.handle else None)
        if shape == "negative-stride":
            assert not g.in_buffer and g.nbytes > SPAN.size  # its span is about 2^32 bytes: no buffer holds it
        elif where in IN_BUFFER:
            assert g.in_buffer, g.describe()
            # An in-buffer place is found as drawn (an empty tensor at the end is "past the end" by address only).
            assert found.place == where or (where == "misaligned" and found.place in ("inside", "at-end")) or \
                (where in ("inside", "at-start", "at-end") and found.place in ("at-start", "at-end", "inside")), \
                (where, found.place, g.describe())
        elif where in ("below", "across-end", "past-end", "other-buffer"):
            assert not g.in_buffer or (g.nbytes == 0 and where == "past-end"), g.describe()
        elif where == "null-buffer":
            assert f["buffer"] == 0 and found.place == "null-buffer"
        else:
            assert f["buffer"] not in (SPAN.handle, OTHER.handle, 0)
        if shape != "negative-stride":
            assert found.shape == shape or _equivalent(shape, found.shape, f), (shape, found.shape, g.describe())


def _equivalent(drawn: str, found: str, f: dict) -> bool:
    """Shapes that coincide for some draws: one row of a block type is a block edge and contiguous alike."""
    if {drawn, found} <= {"contiguous", "block-edge", "one-element", "padded", "transposed"}:
        return TYPES[f["type"]].blck > 1 or f["ne"][1] == 1 or drawn in ("padded", "contiguous")
    return False


def test_in_buffer_edges_touch_the_buffer_edges() -> None:
    c = Seeded(7)
    for i in range(32):
        start = draw_geometry(c, SPAN, id=i, where="at-start", shapes=ORDINARY_SHAPES)
        end = draw_geometry(c, SPAN, id=i, where="at-end", shapes=ORDINARY_SHAPES)
        assert start.fields["data"] == SPAN.base
        assert end.fields["data"] + end.nbytes == SPAN.end


def test_other_and_freed_buffers_are_used_and_fall_back_when_there_are_none() -> None:
    c = Seeded(3)
    g = draw_geometry(c, SPAN, id=1, shape="contiguous", where="other-buffer", others=[OTHER])
    assert g.fields["buffer"] == SPAN.handle and OTHER.base <= g.fields["data"] < OTHER.end
    g = draw_geometry(c, SPAN, id=1, shape="contiguous", where="freed-buffer", freed=[FREED])
    assert g.fields["buffer"] == FREED.handle and FREED.base <= g.fields["data"] < FREED.end
    g = draw_geometry(c, SPAN, id=1, shape="contiguous", where="freed-buffer")
    assert g.place == "unknown-buffer" and g.notes


def test_negative_strides_travel_as_32_bit_values() -> None:
    c = Seeded(5)
    g = draw_geometry(c, SPAN, id=1, shape="negative-stride", where="inside")
    assert g.fields["nb"][1] > NB_MODULUS // 2 and g.nbytes > SPAN.size  # a span of about 4 GiB
    unit = draw_geometry(c, SPAN, id=2, shape="negative-unit", where="inside")
    assert any(s > NB_MODULUS // 2 for s in unit.fields["nb"]) and unit.in_buffer
    assert shape_class(int(GgmlType.F32), [4, 2, 1, 1], [4, NB_MODULUS - 16, 32, 32]) == "negative-stride"


@pytest.mark.parametrize("view", VIEWS)
def test_views_point_into_their_source(view: str) -> None:
    c = Seeded(11)
    base = draw_geometry(c, SPAN, id=1, shape="contiguous", where="inside", types=(int(GgmlType.F32),))
    v = view_of(c, base, id=2, view=view)
    f = v.fields
    assert f["view_src"] == 1 and f["data"] == base.fields["data"] + f["view_offs"] and f["buffer"] == SPAN.handle
    inside = f["view_offs"] + v.nbytes <= base.nbytes
    assert inside is (view != "view-past")
    assert classify(f, SPAN).view == "view"
