"""The conditions of the rule table (:mod:`.rules`) that the reference server's refusals also decide by, each
written once.

Rules of this module (what it may know and what it must not):

1. Each function is the condition of one rule of the table (named in its doc) over plain numbers, or numpy arrays
   for a graph's tensors: no decoded message, no connection state, no server state.  A server that checks a request
   before decoding it whole (the reference reads flat tuples) can so test the very condition the rule's predicate
   tests.
2. The words of a finding or of a refusal stay with whoever reports it: a condition says only whether it holds.
"""

from __future__ import annotations

import numpy as np

from .enums import GGML_TYPE_COUNT, TYPES

#: Per ggml type id: whether the type was removed from ggml (indexed by type; ids at or past the count are unknown).
_REMOVED = np.array([TYPES[t].removed for t in range(GGML_TYPE_COUNT)], dtype=bool)


def unknown_type(type_id: int) -> bool:
    """TENSOR-TYPE: the id is not a ggml type (at or past the type count)."""
    return type_id >= GGML_TYPE_COUNT


def unknown_types(types: np.ndarray) -> np.ndarray:
    """TENSOR-TYPE for many tensors: a mask of the ids that are not ggml types."""
    return types >= GGML_TYPE_COUNT


def removed_type(type_id: int) -> bool:
    """TENSOR-REMOVED-TYPE: a known type id that ggml removed (the caller has ruled out unknown ids)."""
    return bool(_REMOVED[type_id])


def removed_types(types: np.ndarray) -> np.ndarray:
    """TENSOR-REMOVED-TYPE for many tensors (all of them known ids): a mask of the removed ones."""
    return _REMOVED[types]


#: Per ggml type id: elements per block (1 for the plain types; 0 for removed ones).
_BLOCK = np.array([TYPES[t].blck for t in range(GGML_TYPE_COUNT)], dtype=np.int64)


def partial_block(type_id: int, ne0: int) -> bool:
    """#25288 (no table rule yet: the reference refuses it, FRAME-048 checks it): a quantised tensor whose rows end
    inside a block (ne[0] not a multiple of the type's block size). The caller has ruled out unknown ids."""
    blck = int(_BLOCK[type_id])
    return blck > 1 and ne0 % blck != 0


def partial_blocks(types: np.ndarray, ne0: np.ndarray) -> np.ndarray:
    """:func:`partial_block` for many tensors (all of them known ids): a mask."""
    blck = _BLOCK[types]
    return (blck > 1) & (ne0 % np.maximum(blck, 1) != 0)


def block_size(type_id: int) -> int:
    """Elements per block of a known type id (for the words of a refusal)."""
    return int(_BLOCK[type_id])


def region_past(offset: int, n: int, nbytes: int) -> bool:
    """REGION-PAST-TENSOR (and ROWS-PAST-TENSOR with ``n`` the rows' span): a non-empty region ``offset .. offset +
    n`` ends past a tensor of ``nbytes`` bytes (an empty region is never past it)."""
    return n != 0 and offset + n > nbytes


def rows_zero(size: int, n_copies: int) -> bool:
    """ROWS-ZERO: a 2-D region with no bytes per row or no rows."""
    return size == 0 or n_copies == 0


def region_2d_span(size: int, n_copies: int, stride: int) -> int | None:
    """ROWS-ZERO and ROWS-SPAN-OVERFLOW: bytes a 2-D region covers from its first row, ``(n_copies - 1) * stride +
    size``; None when a count is 0 or the span does not fit 64 bits (upstream refuses both)."""
    if rows_zero(size, n_copies):
        return None
    span = (n_copies - 1) * stride + size
    return span if span < 1 << 64 else None


def rows_data_mismatch(size: int, n_copies: int, data_len: int) -> bool:
    """ROWS-DATA-LENGTH: a SET_TENSOR_2D's data is not exactly ``size * n_copies`` bytes."""
    return size * n_copies != data_len


def null_nodes(nodes: np.ndarray) -> np.ndarray:
    """GRAPH-NULL-NODE: a mask of the graph's node ids that are 0."""
    return np.asarray(nodes) == 0


def first_rows(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """GRAPH-NODE-UNKNOWN (-1 for an id no tensor carries): per wanted id, the row of the first tensor whose id it
    is (upstream's first-wins rule for duplicate ids)."""
    uniq, first = np.unique(ids, return_index=True)
    if len(uniq) == 0:
        return np.full(len(wanted), -1, dtype=np.intp)
    pos = np.minimum(np.searchsorted(uniq, wanted), len(uniq) - 1)
    return np.where(uniq[pos] == wanted, first[pos], -1)


__all__ = ["first_rows", "null_nodes", "region_2d_span", "region_past", "removed_type", "removed_types",
           "rows_data_mismatch", "rows_zero", "unknown_type", "unknown_types"]
