"""The IQ grid codebooks, read out of an installed upstream build at run time (never stored in this repository).

IQ1_S/M, IQ2_XXS/XS/S and IQ3_XXS/S index codebooks (lattice points of 4 or 8 small integers) that upstream ships
only as data in its sources.  The kit does not copy them: it asks the installed build's own dequantiser
(``ggml_get_type_traits(type)->to_float`` of libggml-base) to decode probe blocks whose scale is 1, whose sign bits
are clear and whose index fields count through every entry, so each entry's values come out in order.  The tables
are saved beside the peer (``<prefix>/codebooks.npz``) with a note of the build they came from; the reference
executor loads them lazily, extracting them first when the file is missing but a peer is installed.

``GGML_RPC_KIT_CODEBOOKS`` overrides the search: a path to an ``.npz`` written by :func:`save`, or ``off`` (or an
empty value) for none, in which case the executor refuses these types as it does without upstream.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .peers import PEERS, Peer

#: Environment variable naming a codebook file, or ``off``.
ENV = "GGML_RPC_KIT_CODEBOOKS"
#: Bumped when the file's contents change meaning; an older file is extracted again.
FORMAT = 1
FILE_NAME = "codebooks.npz"

QK_K = 256
_ONE_F16 = np.array([1.0], dtype="<f2").view(np.uint8)


@dataclass(frozen=True, slots=True)
class Grid:
    """One codebook: the type whose to_float reveals it, its shape, and how a probe value maps back to an entry."""

    type_id: int
    entries: int
    width: int
    dtype: str
    #: A probe block decodes entry value ``g`` as ``g * scale + offset`` (exact in float32 for these grids).
    scale: float
    offset: float


# Type ids are ggml's numbering (spec.GgmlType): IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18, IQ1_S 19, IQ3_S 21, IQ2_S 22.
GRIDS: dict[str, Grid] = {
    "iq2xxs_grid": Grid(16, 256, 8, "uint8", 0.125, 0.0),
    "iq2xs_grid": Grid(17, 512, 8, "uint8", 0.125, 0.0),
    "iq2s_grid": Grid(22, 1024, 8, "uint8", 0.125, 0.0),
    "iq3xxs_grid": Grid(18, 256, 4, "uint8", 0.25, 0.0),
    "iq3s_grid": Grid(21, 512, 4, "uint8", 1.0, 0.0),
    "iq1s_grid": Grid(19, 2048, 8, "int8", 1.0, 0.125),
}

Tables = dict[str, np.ndarray]


class CodebookError(RuntimeError):
    """The build's dequantiser did not reveal a well-formed codebook."""


# ---- probe blocks: scale 1, clear sign bits, index fields counting through the entries ---------------------------
# Each packer takes the entry indices (n_blocks, per_block) and returns the blocks' bytes (n_blocks, type_size);
# the block layouts are spec.blocks' (the f16 scale first in every one of these types).


def _probe_iq2_xxs(e: np.ndarray) -> np.ndarray:
    # Per 32 elements: 4 index bytes, then a u32 of 4x7 sign bits and a 4-bit scale, all zero.
    qs = np.zeros((e.shape[0], 8, 8), dtype=np.uint8)
    qs[:, :, :4] = e.reshape(-1, 8, 4)
    return np.concatenate([np.broadcast_to(_ONE_F16, (e.shape[0], 2)), qs.reshape(-1, 64)], axis=1)


def _probe_iq2_xs(e: np.ndarray) -> np.ndarray:
    # 32 u16 of 9 index bits and 7 sign bits, then 8 scale bytes (zero).
    qs = e.astype("<u2").view(np.uint8)
    return np.concatenate([np.broadcast_to(_ONE_F16, (e.shape[0], 2)), qs, np.zeros((e.shape[0], 8), np.uint8)],
                          axis=1)


def _probe_iq2_s(e: np.ndarray) -> np.ndarray:
    # 32 low index bytes, 32 sign bytes, 8 bytes of 4x2 high index bits, 8 scale bytes.
    n = e.shape[0]
    high = ((e.reshape(n, 8, 4) >> 8) & 3) << (2 * np.arange(4))
    qh = high.sum(axis=2).astype(np.uint8)
    return np.concatenate([np.broadcast_to(_ONE_F16, (n, 2)), (e & 255).astype(np.uint8),
                           np.zeros((n, 32), np.uint8), qh, np.zeros((n, 8), np.uint8)], axis=1)


def _probe_iq3_xxs(e: np.ndarray) -> np.ndarray:
    # 64 index bytes, then 8 u32 of sign bits and scales (zero).
    n = e.shape[0]
    return np.concatenate([np.broadcast_to(_ONE_F16, (n, 2)), e.astype(np.uint8), np.zeros((n, 32), np.uint8)],
                          axis=1)


def _probe_iq3_s(e: np.ndarray) -> np.ndarray:
    # 64 low index bytes, 8 bytes of 8 ninth bits, 32 sign bytes, 4 scale bytes.
    n = e.shape[0]
    qh = (((e.reshape(n, 8, 8) >> 8) & 1) << np.arange(8)).sum(axis=2).astype(np.uint8)
    return np.concatenate([np.broadcast_to(_ONE_F16, (n, 2)), (e & 255).astype(np.uint8), qh,
                           np.zeros((n, 36), np.uint8)], axis=1)


def _probe_iq1_s(e: np.ndarray) -> np.ndarray:
    # 32 low index bytes, then 8 u16 of 4x3 high index bits, a 3-bit scale and the delta's sign (zero: +delta).
    n = e.shape[0]
    qh = (((e.reshape(n, 8, 4) >> 8) & 7) << (3 * np.arange(4))).sum(axis=2).astype("<u2")
    return np.concatenate([np.broadcast_to(_ONE_F16, (n, 2)), (e & 255).astype(np.uint8), qh.view(np.uint8)],
                          axis=1)


_PROBES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "iq2xxs_grid": _probe_iq2_xxs, "iq2xs_grid": _probe_iq2_xs, "iq2s_grid": _probe_iq2_s,
    "iq3xxs_grid": _probe_iq3_xxs, "iq3s_grid": _probe_iq3_s, "iq1s_grid": _probe_iq1_s,
}


# ---- the build's dequantiser --------------------------------------------------------------------------------------

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _Traits(ctypes.Structure):
    # struct ggml_type_traits of the build's ggml.h
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


class UpstreamDequantizer:
    """``to_float`` of every type, called in one build's libggml-base.so."""

    def __init__(self, bin_dir: Path) -> None:
        self.library = bin_dir / "libggml-base.so"
        self._lib = ctypes.CDLL(str(self.library))
        self._lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self._lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def traits(self, type_id: int) -> _Traits:
        return self._lib.ggml_get_type_traits(type_id).contents

    def to_float(self, type_id: int, blocks: np.ndarray) -> np.ndarray:
        """Blocks (n, type_size) of ``type_id`` to float32 (n * blck_size,), by the build's own code."""
        t = self.traits(type_id)
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        if blocks.ndim != 2 or blocks.shape[1] != t.type_size or not t.to_float:
            raise CodebookError(f"type {type_id}: blocks {blocks.shape} do not fit the build's traits")
        n = blocks.shape[0] * int(t.blck_size)
        out = np.empty(n, dtype=np.float32)
        _TO_FLOAT(t.to_float)(blocks.ctypes.data, out.ctypes.data, n)
        return out


def extract(bin_dir: Path) -> Tables:
    """Every codebook of :data:`GRIDS`, decoded by the build in ``bin_dir`` from probe blocks."""
    deq = UpstreamDequantizer(bin_dir)
    tables: Tables = {}
    for name, g in GRIDS.items():
        per_block = QK_K // g.width
        entries = np.arange(g.entries, dtype=np.int64).reshape(-1, per_block)
        values = deq.to_float(g.type_id, _PROBES[name](entries)).reshape(g.entries, g.width).astype(np.float64)
        grid = (values - g.offset) / g.scale
        info = np.iinfo(g.dtype)
        if not (np.all(grid == np.round(grid)) and grid.min() >= info.min and grid.max() <= info.max):
            raise CodebookError(f"{name}: the probe blocks did not decode to whole {g.dtype} values")
        tables[name] = grid.astype(g.dtype)
    return tables


# ---- the file beside the peer -------------------------------------------------------------------------------------


def codebook_file(peer: Peer) -> Path:
    return peer.prefix / FILE_NAME


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(path: Path, tables: Tables, source: dict[str, object]) -> None:
    """Write ``tables`` and a note of where they came from (``source``) as one ``.npz``, atomically."""
    tmp = path.with_name(path.name + ".tmp.npz")
    meta = json.dumps({"format": FORMAT, **source}, sort_keys=True)
    np.savez(tmp, source=np.array(meta), **tables)
    os.replace(tmp, path)


def load(path: Path) -> tuple[Tables, dict[str, object]] | None:
    """The tables and source note of a file :func:`save` wrote, or None when it is missing or malformed."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            source = json.loads(str(npz["source"]))
            tables = {name: npz[name] for name in GRIDS}
    except (OSError, KeyError, ValueError):
        return None
    for name, g in GRIDS.items():
        if tables[name].shape != (g.entries, g.width) or tables[name].dtype != np.dtype(g.dtype):
            return None
    if source.get("format") != FORMAT:
        return None
    return tables, source


def ensure(peer: Peer, *, force: bool = False) -> Path:
    """Extract ``peer``'s codebooks into its prefix unless a current file is there already; returns the file."""
    path = codebook_file(peer)
    if not force and load(path) is not None:
        return path
    library = peer.bin_dir / "libggml-base.so"
    info = peer.info()
    source = {"peer": peer.version, "package": info.get("package"), "built": info.get("built"),
              "library": str(library), "library_sha256": _sha256(library)}
    save(path, extract(peer.bin_dir), source)
    return path


def find() -> tuple[Tables, dict[str, object]] | None:
    """The codebooks the executor should use: :data:`ENV`'s file, else those of the newest installed peer (extracted
    now if its file is missing), else None."""
    setting = os.environ.get(ENV)
    if setting is not None:
        if setting.strip().lower() in ("", "off", "none", "0"):
            return None
        return load(Path(setting).expanduser())
    for peer in sorted(PEERS.values(), key=lambda p: p.major, reverse=True):
        if not peer.installed():
            continue
        try:
            found = load(ensure(peer))
        except (OSError, CodebookError):
            continue
        if found is not None:
            return found
    return None
