"""Where the generators' choices come from: hypothesis (shrinkable) or a seeded PRNG (fast).

The request generators of :mod:`.valid_requests` and :mod:`.nearvalid` are written once against :class:`Draw`.  Under
:class:`HypothesisDraw` every choice is a hypothesis draw, so hypothesis shrinks each field of a failing request;
under :class:`RandomDraw` the same generators run from one seeded ``random.Random``, which costs a fraction of a
hypothesis draw.  The state machine draws each step's main request through hypothesis and the burst of requests
that follows it from a seed that hypothesis draws (and shrinks: a smaller burst, another seed).

Schema-derived values (any value of a field, any rpc_tensor) come from :mod:`ggml_rpc.spec.strategies` under
hypothesis, and from the same schema walk with the PRNG: integers over their declared range, fixed-length bytes,
arrays and nested Structs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from construct import Struct
from ggml_rpc.spec import strategies as spec_st
from ggml_rpc.spec.schema_walk import FieldInfo, fields, int_range
from ggml_rpc.spec.tensor import RpcTensor
from hypothesis import strategies as st

T = TypeVar("T")


class Draw(Protocol):
    """The choices a generator makes."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...

    def binary(self, max_size: int) -> bytes: ...

    def field(self, info: FieldInfo) -> Any: ...

    def tensor(self) -> dict[str, Any]: ...


_ANY_TENSOR = spec_st.tensors()


class HypothesisDraw:
    """Choices drawn by hypothesis (inside a strategy or a rule): shrinkable one by one."""

    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return options[self._draw(st.integers(0, len(options) - 1))]

    def binary(self, max_size: int) -> bytes:
        return self._draw(st.binary(max_size=max_size))

    def field(self, info: FieldInfo) -> Any:
        return self._draw(spec_st.field_values(info))

    def tensor(self) -> dict[str, Any]:
        return self._draw(_ANY_TENSOR)


class RandomDraw:
    """Choices from a seeded PRNG; integers lean towards their bounds, as hypothesis' do."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.06:
            return lo
        if pick < 0.12:
            return hi
        if pick < 0.5 and hi - lo > 256:
            # Small values matter most (sizes, counts, offsets): as often as the whole range.
            return lo + r.randint(0, 256)
        return r.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def binary(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.integer(0, max_size))

    def field(self, info: FieldInfo) -> Any:
        if info.kind == "int":
            return self.integer(*int_range(info.fmt))
        if info.kind == "bytes":
            return self.rng.randbytes(info.length)
        if info.kind == "struct":
            assert info.struct is not None
            return self.struct(info.struct)
        count = info.count if isinstance(info.count, int) else self.integer(0, spec_st.DEFAULT_MAX_COUNT)
        if info.kind == "array":
            lo, hi = int_range(info.fmt)
            return [self.integer(lo, hi) for _ in range(count)]
        assert info.struct is not None
        return [self.struct(info.struct) for _ in range(count)]

    def struct(self, schema: Struct) -> dict[str, Any]:
        infos = fields(schema)
        counted = {f.count: f.name for f in infos if isinstance(f.count, str)}
        out = {f.name: self.field(f) for f in infos if f.name not in counted}
        for count_name, array_name in counted.items():
            out[count_name] = len(out[array_name])
        return {f.name: out[f.name] for f in infos}

    def tensor(self) -> dict[str, Any]:
        return self.struct(RpcTensor)
