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

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ggml_rpc.reference.executor.grids import CODEBOOKS
from ggml_rpc.spec.blocks import QK_K, pack_blocks

from .ggml_lib import BASE_LIBRARY, GgmlLibrary
from .peers import PEERS, Peer

#: Environment variable naming a codebook file, or ``off``.
ENV = "GGML_RPC_KIT_CODEBOOKS"
#: Bumped when the file's contents change meaning; an older file is extracted again.
FORMAT = 1
FILE_NAME = "codebooks.npz"

_ONE_F16 = np.array([1.0], dtype="<f2").view(np.uint8)

Tables = dict[str, np.ndarray]


class CodebookError(RuntimeError):
    """The build's dequantiser did not reveal a well-formed codebook."""


# ---- probe blocks: scale 1, clear sign bits, index fields counting through the entries ---------------------------
# Each packer takes the entry indices (n_blocks, per_block) and fills the fields of the block layout in spec.blocks.


def _probe_iq2_xxs(t: int, e: np.ndarray) -> np.ndarray:
    # Per 32 elements: 4 index bytes, then a u32 of 4x7 sign bits and a 4-bit scale, all zero.
    qs = np.zeros((e.shape[0], 8, 8), dtype=np.uint8)
    qs[:, :, :4] = e.reshape(-1, 8, 4)
    return pack_blocks(t, e.shape[0], d=_ONE_F16, qs=qs.reshape(-1, 64))


def _probe_iq2_xs(t: int, e: np.ndarray) -> np.ndarray:
    # 32 u16 of 9 index bits and 7 sign bits (zero); 4-bit scales (zero).
    return pack_blocks(t, e.shape[0], d=_ONE_F16, qs=e.astype("<u2").view(np.uint8), scales=0)


def _probe_iq2_s(t: int, e: np.ndarray) -> np.ndarray:
    # qs: 32 low index bytes, then 32 sign bytes; qh: 4x2 high index bits per group of 32.
    n = e.shape[0]
    qh = (((e.reshape(n, 8, 4) >> 8) & 3) << (2 * np.arange(4))).sum(axis=2).astype(np.uint8)
    qs = np.concatenate([(e & 255).astype(np.uint8), np.zeros((n, 32), np.uint8)], axis=1)
    return pack_blocks(t, n, d=_ONE_F16, qs=qs, qh=qh, scales=0)


def _probe_iq3_xxs(t: int, e: np.ndarray) -> np.ndarray:
    # qs: 64 index bytes, then 8 u32 of sign bits and scales (zero).
    n = e.shape[0]
    return pack_blocks(t, n, d=_ONE_F16, qs=np.concatenate([e.astype(np.uint8), np.zeros((n, 32), np.uint8)], axis=1))


def _probe_iq3_s(t: int, e: np.ndarray) -> np.ndarray:
    # 64 low index bytes, their ninth bits in qh; signs and scales zero.
    n = e.shape[0]
    qh = (((e.reshape(n, 8, 8) >> 8) & 1) << np.arange(8)).sum(axis=2).astype(np.uint8)
    return pack_blocks(t, n, d=_ONE_F16, qs=(e & 255).astype(np.uint8), qh=qh, signs=0, scales=0)


def _probe_iq1_s(t: int, e: np.ndarray) -> np.ndarray:
    # 32 low index bytes; qh: 8 u16 of 4x3 high index bits, a 3-bit scale and the delta's sign (zero: +delta).
    n = e.shape[0]
    qh = (((e.reshape(n, 8, 4) >> 8) & 7) << (3 * np.arange(4))).sum(axis=2).astype("<u2")
    return pack_blocks(t, n, d=_ONE_F16, qs=(e & 255).astype(np.uint8), qh=qh.view(np.uint8))


@dataclass(frozen=True, slots=True)
class _Probe:
    """How a codebook is read: the packer of its probe blocks, and how a decoded value ``v`` maps back to the
    entry's integer (``(v - offset) / scale``, exact in float32 for these grids)."""

    pack: Callable[[int, np.ndarray], np.ndarray]
    scale: float
    offset: float


_PROBES: dict[str, _Probe] = {
    "iq2xxs_grid": _Probe(_probe_iq2_xxs, 0.125, 0.0), "iq2xs_grid": _Probe(_probe_iq2_xs, 0.125, 0.0),
    "iq2s_grid": _Probe(_probe_iq2_s, 0.125, 0.0), "iq3xxs_grid": _Probe(_probe_iq3_xxs, 0.25, 0.0),
    "iq3s_grid": _Probe(_probe_iq3_s, 1.0, 0.0), "iq1s_grid": _Probe(_probe_iq1_s, 1.0, 0.125),
}


def extract(bin_dir: Path) -> Tables:
    """Every codebook of the executor's table, decoded by the build in ``bin_dir`` from probe blocks."""
    lib = GgmlLibrary(bin_dir)
    tables: Tables = {}
    for name, book in CODEBOOKS.items():
        probe, t = _PROBES[name], book.types[0]  # the first type that indexes it reveals it
        entries = np.arange(book.entries, dtype=np.int64).reshape(-1, QK_K // book.width)
        try:
            values = lib.to_float(t, probe.pack(t, entries))
        except ValueError as exc:
            raise CodebookError(f"{name}: {exc}") from None
        grid = (values.reshape(book.entries, book.width).astype(np.float64) - probe.offset) / probe.scale
        info = np.iinfo(book.dtype)
        if not (np.all(grid == np.round(grid)) and grid.min() >= info.min and grid.max() <= info.max):
            raise CodebookError(f"{name}: the probe blocks did not decode to whole {book.dtype} values")
        tables[name] = grid.astype(book.dtype)
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
            tables = {name: npz[name] for name in CODEBOOKS}
    except (OSError, KeyError, ValueError):
        return None
    for name, book in CODEBOOKS.items():
        if tables[name].shape != (book.entries, book.width) or tables[name].dtype != np.dtype(book.dtype):
            return None
    if source.get("format") != FORMAT:
        return None
    return tables, source


def ensure(peer: Peer, *, force: bool = False) -> Path:
    """Extract ``peer``'s codebooks into its prefix unless a current file is there already; returns the file."""
    path = codebook_file(peer)
    if not force and load(path) is not None:
        return path
    if peer.kind == "wheel":
        # Its libraries need a newer glibc than this process may have: they cannot be loaded here with ctypes.
        raise CodebookError(f"{peer.version} is a wheel peer: its codebooks are not read (the 6/7 builds' serve)")
    library = peer.bin_dir / BASE_LIBRARY
    info = peer.info()
    source = {"peer": peer.version, "package": info.get("package"), "built": info.get("built"),
              "library": str(library), "library_sha256": _sha256(library)}
    save(path, extract(peer.bin_dir), source)
    return path


def tables() -> Tables | None:
    """The codebooks a reference server should use (its ``codebooks`` source): those :func:`find` finds, or None."""
    found = find()
    return None if found is None else found[0]


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
