"""Block layouts of the quantised types: complete, the type table's sizes, and what the executor packs by."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from ggml_rpc.spec import TYPES
from ggml_rpc.spec.blocks import BLOCKS, block_fields, block_layout, pack_blocks

QUANTISED = [t.id for t in TYPES.values() if t.quantized and not t.removed]


def test_every_quantised_type_has_a_layout_and_nothing_else_does() -> None:
    assert sorted(int(t) for t in BLOCKS) == sorted(QUANTISED)


@pytest.mark.parametrize("type_id", QUANTISED)
def test_fields_tile_the_block_exactly(type_id: int) -> None:
    layout = block_layout(type_id)
    assert layout[0].start == 0 and layout[-1].stop == TYPES[type_id].size
    for a, b in itertools.pairwise(layout):
        assert a.stop == b.start and a.stop > a.start
    assert all(f.doc for f in layout)  # every field says what it holds
    assert BLOCKS[type_id].sizeof() == TYPES[type_id].size


def test_known_offsets() -> None:
    # ggml-common.h: block_q4_0 {d; qs[16]}, block_q6_k {ql[128]; qh[64]; scales[16]; d}
    assert block_fields(2) == {"d": slice(0, 2), "qs": slice(2, 18)}
    assert block_fields(14) == {"ql": slice(0, 128), "qh": slice(128, 192), "scales": slice(192, 208),
                                "d": slice(208, 210)}


def test_pack_blocks_writes_every_field_and_refuses_a_missing_one() -> None:
    d = np.full((3, 2), 0xAB, dtype=np.uint8)
    qs = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    out = pack_blocks(2, 3, d=d, qs=qs)
    assert out.shape == (3, 18) and (out[:, :2] == 0xAB).all() and (out[:, 2:] == qs).all()
    with pytest.raises(ValueError, match="fields"):
        pack_blocks(2, 3, d=d)


def test_layouts_decode_a_block_with_construct() -> None:
    # The Structs are real construct schemas: a Q8_0 block parses into its scale and 32 signed codes.
    raw = np.float16(0.5).tobytes() + bytes(range(256 - 16, 256)) + bytes(range(16))
    block = BLOCKS[8].parse(raw)
    assert block.d == 0.5 and list(block.qs[:2]) == [-16, -15] and list(block.qs[-1:]) == [15]
