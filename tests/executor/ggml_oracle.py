"""Upstream's own (de)quantisers, called in the installed upstream build's shared libraries through ctypes.

The CPU backend's ``from_float`` (what a CPY or SET_ROWS into a quantised tensor runs) and the base library's
``to_float``, so tests can compare the executor's block bytes with ggml's on many random blocks.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from ggml_rpc.spec import TYPES

_CONV = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _Traits(ctypes.Structure):
    # struct ggml_type_traits of ggml.h
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


class _CpuTraits(ctypes.Structure):
    # struct ggml_type_traits_cpu of ggml-cpu.h
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class GgmlOracle:
    """ggml's quantisation entry points of one upstream build (``bin`` holds libggml-base.so and libggml-cpu.so)."""

    def __init__(self, bin_dir: Path) -> None:
        self._base = ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self._cpu = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self._base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self._cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
        self._cpu.ggml_cpu_init()

    def from_float(self, type_id: int, x: np.ndarray) -> np.ndarray:
        """The CPU backend's quantisation of ``x`` (float32, a whole number of blocks) to block bytes."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        info = TYPES[type_id]
        out = np.zeros(x.size // info.blck * info.size, dtype=np.uint8)
        _CONV(self._cpu.ggml_get_type_traits_cpu(type_id).contents.from_float)(x.ctypes.data, out.ctypes.data, x.size)
        return out.reshape(-1, info.size)

    def to_float(self, type_id: int, blocks: np.ndarray) -> np.ndarray:
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        n = blocks.size // TYPES[type_id].size * TYPES[type_id].blck
        out = np.empty(n, dtype=np.float32)
        _CONV(self._base.ggml_get_type_traits(type_id).contents.to_float)(blocks.ctypes.data, out.ctypes.data, n)
        return out

    def vec_dot_type(self, type_id: int) -> int:
        return int(self._cpu.ggml_get_type_traits_cpu(type_id).contents.vec_dot_type)
