"""What a replay keeps of the target's state, connection by connection.

Server-assigned values of a capture are relocated to the target's: :class:`Relocator` maps ``remote_ptr`` handles
learnt from ALLOC_BUFFER replies and bases from BUFFER_GET_BASE, then rewrites every tensor's ``buffer`` and
``data`` in every later request (``data = new_base + (old_data - old_base)``), GRAPH_COMPUTE's tensors as one
vectorised numpy operation.  :class:`TargetCache` models the target's hash cache: fresh at the start, filled by the
payloads the target's cache rule saves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ggml_rpc.spec import Protocol, fnv1a64


class Relocator:
    """Old (captured) buffer handles and bases to the target's, for one connection."""

    def __init__(self) -> None:
        self.handles: dict[int, int] = {}
        self.bases: dict[int, tuple[int, int]] = {}  # old handle -> (old base, new base)
        self._arrays: tuple[np.ndarray, ...] | None = None

    def buffer(self, old: int, new: int) -> None:
        if old:
            self.handles[old] = new
            self.bases.pop(old, None)
            self._arrays = None

    def base(self, old_handle: int, old_base: int, new_base: int) -> None:
        self.bases[old_handle] = (old_base, new_base)
        self._arrays = None

    def handle(self, old: int) -> int:
        return self.handles.get(old, old)

    def tensor(self, t: dict[str, Any]) -> dict[str, Any]:
        old = t["buffer"]
        if not old or old not in self.handles:
            return t
        t = dict(t)
        t["buffer"] = self.handles[old]
        if t["data"] and old in self.bases:
            old_base, new_base = self.bases[old]
            t["data"] = (new_base + (t["data"] - old_base)) & 0xFFFFFFFFFFFFFFFF
        return t

    def fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A copy of a request's fields with every tensor, handle and tensor list relocated."""
        out = dict(fields)
        for key, value in fields.items():
            if key == "remote_ptr":
                out[key] = self.handle(value)
            elif isinstance(value, dict) and "buffer" in value:
                out[key] = self.tensor(value)
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                out[key] = [self.tensor(v) for v in value]
            elif key == "tensors" and isinstance(value, np.ndarray):
                out[key] = self.tensor_array(value)
        return out

    def tensor_array(self, tensors: np.ndarray) -> np.ndarray:
        """GRAPH_COMPUTE's tensors relocated in one pass (a new array; the capture is not touched)."""
        # Copied as raw bytes: numpy copies a packed structured array field by field, several times slower.
        out = np.ascontiguousarray(tensors).view(np.uint8).copy().view(tensors.dtype)
        if not self.handles or not len(out):
            return out
        if self._arrays is None:
            keys = np.array(sorted(self.handles), dtype=np.uint64)
            new = np.array([self.handles[int(k)] for k in keys], dtype=np.uint64)
            has_base = np.array([int(k) in self.bases for k in keys], dtype=bool)
            old_base = np.array([self.bases.get(int(k), (0, 0))[0] for k in keys], dtype=np.uint64)
            new_base = np.array([self.bases.get(int(k), (0, 0))[1] for k in keys], dtype=np.uint64)
            self._arrays = (keys, new, has_base, old_base, new_base)
        keys, new, has_base, old_base, new_base = self._arrays
        buf = out["buffer"]
        idx = np.searchsorted(keys, buf)
        idx_c = np.minimum(idx, len(keys) - 1)
        known = (idx < len(keys)) & (keys[idx_c] == buf)
        data = out["data"]
        move = known & (data != 0) & has_base[idx_c]
        pos = idx_c[move]
        with np.errstate(over="ignore"):
            data[move] = new_base[pos] + (data[move] - old_base[pos])
        buf[known] = new[idx_c[known]]
        return out


class TargetCache:
    """What the target's hash cache holds, as far as this replay can know: payloads its rule saved."""

    def __init__(self, protocol: Protocol) -> None:
        self.rule = protocol.cache_rule
        self.hashes: set[int] = set()
        self._unhashed: list[memoryview] = []

    def sent(self, data: memoryview | None, cache_flag: int) -> None:
        n = data.nbytes if data is not None else 0
        if data is not None and self.rule.server_saves(n, cache_flag):
            self._unhashed.append(data)

    def holds(self, digest: int) -> bool:
        if digest in self.hashes:
            return True
        while self._unhashed:
            self.hashes.add(fnv1a64(self._unhashed.pop()))
        return digest in self.hashes
