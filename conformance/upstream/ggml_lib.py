"""Upstream's own (de)quantisers, called in an installed build's shared libraries through ctypes.

``to_float`` of the base library (``ggml_get_type_traits``) and, loaded only when asked, the CPU backend's
``from_float`` and ``vec_dot_type`` (``ggml_get_type_traits_cpu``).  The codebook extraction reads the IQ grids with
it; the tests compare the executor's block bytes and values with ggml's through it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from ggml_rpc.spec import TYPES

#: The libraries of a build's bin directory that hold the type traits.
BASE_LIBRARY, CPU_LIBRARY = "libggml-base.so", "libggml-cpu.so"

_CONV = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
# ggml_vec_dot_t: (n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc)
_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                        ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _Traits(ctypes.Structure):
    # struct ggml_type_traits of the build's ggml.h
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


class _CpuTraits(ctypes.Structure):
    # struct ggml_type_traits_cpu of the build's ggml-cpu.h
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class GgmlLibrary:
    """The quantisation entry points of one upstream build (``bin_dir`` holds libggml-base.so, libggml-cpu.so)."""

    def __init__(self, bin_dir: Path, base: str = BASE_LIBRARY, cpu: str = CPU_LIBRARY) -> None:
        # A wheel names its libraries with their soname version (libggml-cpu.so.0): ``base`` and ``cpu``.
        self._cpu_path = bin_dir / cpu
        self._base = ctypes.CDLL(str(bin_dir / base), mode=ctypes.RTLD_GLOBAL)
        self._base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self._base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self._cpu: ctypes.CDLL | None = None

    def _cpu_traits(self, type_id: int) -> _CpuTraits:
        if self._cpu is None:
            # Only from_float and vec_dot_type need the CPU backend (and its one-time init).
            cpu = ctypes.CDLL(str(self._cpu_path), mode=ctypes.RTLD_GLOBAL)
            cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
            cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
            cpu.ggml_cpu_init()
            self._cpu = cpu
        return self._cpu.ggml_get_type_traits_cpu(type_id).contents

    def to_float(self, type_id: int, blocks: np.ndarray) -> np.ndarray:
        """Blocks (n, type_size) of ``type_id`` to float32 (n * block elements,), by the build's own code."""
        traits = self._base.ggml_get_type_traits(type_id).contents
        info = TYPES[type_id]
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        if traits.type_size != info.size or int(traits.blck_size) != info.blck or not traits.to_float:
            raise ValueError(f"{info.name}: the build's traits ({traits.type_size} bytes per {traits.blck_size} "
                             f"elements) are not spec's ({info.size} per {info.blck})")
        if blocks.size % info.size:
            raise ValueError(f"{info.name}: {blocks.size} bytes are not a whole number of {info.size}-byte blocks")
        n = blocks.size // info.size * info.blck
        out = np.empty(n, dtype=np.float32)
        _CONV(traits.to_float)(blocks.ctypes.data, out.ctypes.data, n)
        return out

    def from_float(self, type_id: int, x: np.ndarray) -> np.ndarray:
        """The CPU backend's quantisation of ``x`` (float32, a whole number of blocks) to block bytes."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        info = TYPES[type_id]
        out = np.zeros(x.size // info.blck * info.size, dtype=np.uint8)
        _CONV(self._cpu_traits(type_id).from_float)(x.ctypes.data, out.ctypes.data, x.size)
        return out.reshape(-1, info.size)

    def vec_dot(self, type_id: int, x_blocks: np.ndarray, y_blocks: np.ndarray) -> float:
        """The CPU backend's dot product of one row of ``type_id`` blocks with one row of its vec-dot type's blocks
        (``ggml_vec_dot_*``, the kernel a one-token MUL_MAT runs)."""
        traits = self._cpu_traits(type_id)
        x = np.ascontiguousarray(x_blocks, dtype=np.uint8)
        y = np.ascontiguousarray(y_blocks, dtype=np.uint8)
        n = x.size // TYPES[type_id].size * TYPES[type_id].blck
        out = ctypes.c_float()
        _DOT(traits.vec_dot)(n, ctypes.byref(out), 0, x.ctypes.data, 0, y.ctypes.data, 0, 1)
        return float(out.value)

    def vec_dot_type(self, type_id: int) -> int:
        return int(self._cpu_traits(type_id).vec_dot_type)
