"""The tensor table of a GGUF file, read with the kit's own type table.

``gguf``'s reader refuses a file holding a type its release does not know (llama-quantize's Q2_0, type 42, is newer
than gguf 0.19), and what the matrix needs of a model is only each tensor's name, type and size.  The header is read
field by field from the file (the key/value section skipped, the vocabulary's 32,000 strings included), so nothing
but the header is held.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ggml_rpc.spec import TYPES

#: GGUF value types with a fixed size, by their id.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: A header larger than this is not a model the kit made: refuse rather than read on.
MAX_HEADER_ITEMS = 10_000_000


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    ne: tuple[int, ...]

    @property
    def type_name(self) -> str:
        info = TYPES.get(self.type_id)
        return info.name if info else f"type {self.type_id}"

    @property
    def nbytes(self) -> int:
        info = TYPES.get(self.type_id)
        if info is None:
            raise ValueError(f"{self.name}: unknown ggml type {self.type_id}")
        n = 1
        for d in self.ne:
            n *= d
        return n // info.blck * info.size


class _Reader:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError(f"{self.path}: GGUF header ends early")
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def count(self) -> int:
        n = self.u64()
        if n > MAX_HEADER_ITEMS:
            raise ValueError(f"{self.path}: a GGUF count of {n} is not plausible")
        return n

    def string(self) -> str:
        return self.take(self.count()).decode("utf-8", "replace")

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.f.seek(_FIXED[vtype], 1)
        elif vtype == _STRING:
            self.f.seek(self.count(), 1)
        elif vtype == _ARRAY:
            item, n = self.u32(), self.count()
            if item in _FIXED:
                self.f.seek(_FIXED[item] * n, 1)
            else:
                for _ in range(n):
                    self.skip_value(item)
        else:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")


def tensor_infos(path: Path) -> list[TensorInfo]:
    """Every tensor of the GGUF file ``path``, in file order."""
    with open(path, "rb") as f:
        r = _Reader(f, Path(path))
        if r.take(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = r.u32()
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and later are)")
        n_tensors, n_kv = r.count(), r.count()
        for _ in range(n_kv):
            r.string()
            r.skip_value(r.u32())
        out = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.u32()
            if n_dims > 4:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions")
            ne = tuple(r.u64() for _ in range(n_dims))
            type_id = r.u32()
            r.u64()  # offset in the data section
            out.append(TensorInfo(name, type_id, ne))
        return out
