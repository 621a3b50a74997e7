"""Where a request's device, buffer and tensors are: upstream's deserialize_tensor and its checks, for every command
group of a reference connection (each is given the one :class:`Resolver` of its connection).

A tensor's type is checked by the rule table's own conditions (:mod:`ggml_rpc.spec.conditions`), so the
:class:`.closing.Close` of a bad type or of a region past the tensor carries the rule's id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ggml_rpc.spec import ggml_nbytes, type_name
from ggml_rpc.spec.conditions import block_size, partial_block, region_past, removed_type, unknown_type
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.tensor import RpcTensor

from .closing import Close
from .closing import upstream as _upstream
from .devices import U64_MASK, Buffer, BufferTable

#: Tensor sizes remembered per connection (the memo is emptied when full).
_NBYTES_REMEMBERED = 4096
#: Sees every single-command tensor as its decoded dict, before it is checked (command, role): may raise.
TensorHook = Callable[[Mapping[str, Any], str, str], None]


@dataclass(slots=True)
class Tensor:
    """A deserialized single-command tensor: its buffer (None = null buffer), nbytes and data address; its fields
    as a dict only where a handler needs more than those (None on the flat fast path)."""

    fields: Mapping[str, Any] | None
    buffer: Buffer | None
    nbytes: int
    data: int


# Flat-tuple positions of the rpc_tensor fields a single-command check reads, relative to the tensor's start.
TENSOR_LAYOUT = flat_layout(RpcTensor)
_T = TENSOR_LAYOUT.slots()
T_ID, T_TYPE, _T_BUFFER, _T_DATA = _T["id"][0], _T["type"][0], _T["buffer"][0], _T["data"][0]
_T_NE, _T_NB = slice(_T["ne"][0], sum(_T["ne"])), slice(_T["nb"][0], sum(_T["nb"]))


class Resolver:
    """One connection's lookups: devices by index, buffers by handle, tensors checked against their buffer."""

    def __init__(self, table: BufferTable, devices: int, hook: TensorHook | None = None) -> None:
        self.table = table
        self.devices = devices
        self._hook = hook
        self._nbytes: dict[tuple, int] = {}

    def device(self, device: int, command: str) -> int:
        if device >= self.devices:
            raise Close(f"{command}: device {device} >= device count {self.devices}{_upstream('close')}")
        return device

    def buffer(self, handle: int, command: str) -> Buffer:
        buf = self.table.get(handle)
        if buf is None:
            raise Close(f"{command}: unknown buffer handle {handle:#x}{_upstream('close')}")
        return buf

    def tensor(self, t: Mapping[str, Any], command: str, what: str = "tensor") -> Tensor:
        """deserialize_tensor of a decoded tensor dict (see :meth:`_checked`)."""
        if self._hook is not None:
            self._hook(t, command, what)
        return self._checked(t["type"], tuple(t["ne"]), tuple(t["nb"]), t["buffer"], t["data"], t, command, what)

    def flat_tensor(self, flat: tuple, start: int, command: str, what: str = "tensor") -> Tensor:
        """deserialize_tensor of the rpc_tensor at ``start`` in a request's flat tuple (see :meth:`_checked`)."""
        if self._hook is not None:  # a test's hook sees every tensor as the dict it expects
            record = TENSOR_LAYOUT.unpack(TENSOR_LAYOUT.struct.pack(*flat[start : start + TENSOR_LAYOUT.width]))
            return self.tensor(record, command, what)
        t = flat[start : start + TENSOR_LAYOUT.width]
        return self._checked(t[T_TYPE], t[_T_NE], t[_T_NB], t[_T_BUFFER], t[_T_DATA], None, command, what)

    def _checked(self, ttype: int, ne: tuple[int, ...], nb: tuple[int, ...], handle: int, d: int,
                 fields: Mapping[str, Any] | None, command: str, what: str) -> Tensor:
        """deserialize_tensor: type checks (close), unknown buffer -> null, data must lie inside its buffer."""
        # A client names the same few tensors again and again: their sizes are remembered (bounded), and a
        # remembered one has passed the type rules already.
        key = (ttype, ne, nb)
        nbytes = self._nbytes.get(key)
        if nbytes is None:
            if unknown_type(ttype):
                raise Close(f"{command}: {what} type {ttype} is not a ggml type{_upstream('close')}", "TENSOR-TYPE")
            if removed_type(ttype):
                raise Close(f"{command}: {what} has removed type {type_name(ttype)}{_upstream('close')}",
                            "TENSOR-REMOVED-TYPE")
            if partial_block(ttype, ne[0]):
                # #25288: sizes and kernels assume whole blocks; a partial one is read or written past the tensor.
                raise Close(f"{command}: {what} ne[0] = {ne[0]} is not a multiple of {type_name(ttype)}'s block "
                            f"size {block_size(ttype)}{_upstream('an assertion, compiled out of release builds')}")
            nbytes = ggml_nbytes(ttype, ne, nb)
            if len(self._nbytes) >= _NBYTES_REMEMBERED:
                self._nbytes.clear()
            self._nbytes[key] = nbytes
        buf = self.table.buffers.get(handle) if handle else None
        if buf is not None and (d < buf.base or d + nbytes > buf.end):
            raise Close(f"{command}: {what} data [{d:#x}, +{nbytes}) lies outside its buffer "
                        f"[{buf.base:#x}, +{buf.size}){_upstream('process abort, buffer-range assertion')}")
        return Tensor(fields, buf, nbytes, d)

    @staticmethod
    def region(t: Tensor, offset: int, n: int, command: str, *, write: bool = False) -> memoryview:
        """The bytes [data+offset, +n) of a tensor, checked as upstream SET/GET_TENSOR check them, and safely;
        ``write``: to be written (the buffer is marked written, :meth:`~.devices.Buffer.write_view`)."""
        if t.buffer is None:
            raise Close(f"{command}: tensor has no buffer (null or unknown handle){_upstream('close')}")
        buf = t.buffer
        start = (t.data + offset) & U64_MASK
        if start < buf.base or start >= buf.end or n > buf.end - start:
            raise Close(f"{command}: region [{start:#x}, +{n}) outside the buffer [{buf.base:#x}, +{buf.size})"
                        f"{_upstream('close')}")
        if region_past(offset, n, t.nbytes):
            raise Close(f"{command}: region offset {offset} + {n} bytes runs past the tensor's {t.nbytes} bytes"
                        f"{_upstream('process abort, tensor out of bounds assertion')}", "REGION-PAST-TENSOR")
        if write:
            return buf.write_view(start - buf.base, n)
        return buf.slice(start, n)


__all__ = ["TENSOR_LAYOUT", "Resolver", "Tensor", "TensorHook"]
