"""The reference connection's tensor commands: deserialize_tensor's checks, SET/GET/MEMSET/COPY_TENSOR,
SET_TENSOR_HASH, INIT_TENSOR, GET_ALLOC_SIZE and GET_DEVICE_SUPPORTS_OP (a mixin of :class:`.core.ServerCore`).

Hot commands read the flat tuple of their request's derived layout (``*_flat`` handlers) instead of a nested dict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from ggml_rpc.spec import TYPES, Command, Payload, ggml_nbytes, type_name
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.enums import GGML_TYPE_COUNT
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.tensor import RpcTensor

from .closing import Bulk, Close
from .closing import upstream as _upstream
from .devices import U64_MASK, Buffer

log = logging.getLogger("ggml_rpc.reference")

_SIZE_LIMIT = 1 << 63  # upstream: a length error it does not catch (process abort)
#: A command with a fixed head before its bulk data: (head size, size checks, from the claimed size and the head
#: (a buffer and its offset there) to where the data goes: one view, a :class:`.closing.Bulk`, or None for no data).
Headed = tuple[int, Callable[[int], None], Callable[[int, Any, int], "memoryview | Bulk | None"]]
#: Tensor sizes remembered per connection (the memo is emptied when full).
_NBYTES_REMEMBERED = 4096
#: Longest a SET_TENSOR_HASH miss waits for saves under way on other connections (--concurrent only).
_SAVE_WAIT = 5.0


@dataclass(slots=True)
class _Tensor:
    """A deserialized single-command tensor: its buffer (None = null buffer), nbytes and data address; its fields
    as a dict only where a handler needs more than those (None on the flat fast path)."""

    fields: Mapping[str, Any] | None
    buffer: Buffer | None
    nbytes: int
    data: int


# Flat-tuple positions of the rpc_tensor fields a single-command check reads, relative to the tensor's start.
_TENSOR = flat_layout(RpcTensor)
_T = _TENSOR.slots()
_T_ID, _T_TYPE, _T_BUFFER, _T_DATA = _T["id"][0], _T["type"][0], _T["buffer"][0], _T["data"][0]
_T_NE, _T_NB = slice(_T["ne"][0], sum(_T["ne"])), slice(_T["nb"][0], sum(_T["nb"]))


class TensorCommands:
    """Tensor checks and tensor-data commands; needs the connection's table, cache, protocol and send methods."""

    # ---- deserialize_tensor ---------------------------------------------------------------------------------------

    def _tensor(self, t: Mapping[str, Any], command: str, what: str = "tensor") -> _Tensor:
        """deserialize_tensor of a decoded tensor dict (see :meth:`_checked`)."""
        if self._tensor_hook is not None:
            self._tensor_hook(t, command, what)
        return self._checked(t["type"], tuple(t["ne"]), tuple(t["nb"]), t["buffer"], t["data"], t, command, what)

    def _flat_tensor(self, flat: tuple, start: int, command: str, what: str = "tensor") -> _Tensor:
        """deserialize_tensor of the rpc_tensor at ``start`` in a request's flat tuple (see :meth:`_checked`)."""
        if self._tensor_hook is not None:  # a test's hook sees every tensor as the dict it expects
            record = _TENSOR.unpack(_TENSOR.struct.pack(*flat[start : start + _TENSOR.width]))
            return self._tensor(record, command, what)
        t = flat[start : start + _TENSOR.width]
        return self._checked(t[_T_TYPE], t[_T_NE], t[_T_NB], t[_T_BUFFER], t[_T_DATA], None, command, what)

    def _checked(self, ttype: int, ne: tuple[int, ...], nb: tuple[int, ...], handle: int, d: int,
                 fields: Mapping[str, Any] | None, command: str, what: str) -> _Tensor:
        """deserialize_tensor: type checks (close), unknown buffer -> null, data must lie inside its buffer."""
        if ttype >= GGML_TYPE_COUNT:
            raise Close(f"{command}: {what} type {ttype} is not a ggml type{_upstream('close')}")
        if TYPES[ttype].removed:
            raise Close(f"{command}: {what} has removed type {type_name(ttype)}{_upstream('close')}")
        blck = TYPES[ttype].blck
        if blck > 1 and ne[0] % blck:
            # #25288: sizes and kernels assume whole blocks; a partial one is read or written past the tensor.
            raise Close(f"{command}: {what} ne[0] = {ne[0]} is not a multiple of {type_name(ttype)}'s block size "
                        f"{blck}{_upstream('an assertion, compiled out of release builds')}")
        # A client names the same few tensors again and again: their sizes are remembered (bounded).
        key = (ttype, ne, nb)
        nbytes = self._nbytes.get(key)
        if nbytes is None:
            nbytes = ggml_nbytes(ttype, ne, nb)
            if len(self._nbytes) >= _NBYTES_REMEMBERED:
                self._nbytes.clear()
            self._nbytes[key] = nbytes
        buf = self.table.buffers.get(handle) if handle else None
        if buf is not None and (d < buf.base or d + nbytes > buf.end):
            raise Close(f"{command}: {what} data [{d:#x}, +{nbytes}) lies outside its buffer "
                        f"[{buf.base:#x}, +{buf.size}){_upstream('process abort, buffer-range assertion')}")
        return _Tensor(fields, buf, nbytes, d)

    def _region(self, t: _Tensor, offset: int, n: int, command: str) -> memoryview:
        """The bytes [data+offset, +n) of a tensor, checked as upstream SET/GET_TENSOR check them, and safely."""
        if t.buffer is None:
            raise Close(f"{command}: tensor has no buffer (null or unknown handle){_upstream('close')}")
        buf = t.buffer
        start = (t.data + offset) & U64_MASK
        if start < buf.base or start >= buf.end or n > buf.end - start:
            raise Close(f"{command}: region [{start:#x}, +{n}) outside the buffer [{buf.base:#x}, +{buf.size})"
                        f"{_upstream('close')}")
        if n and offset + n > t.nbytes:
            raise Close(f"{command}: region offset {offset} + {n} bytes runs past the tensor's {t.nbytes} bytes"
                        f"{_upstream('process abort, tensor out of bounds assertion')}")
        return buf.slice(start, n)

    # ---- tensor data -----------------------------------------------------------------------------------------

    def _set_tensor_runner(self, payload: Payload, head_size: int) -> Headed:
        """SET_TENSOR: its size checks, then from ``head_size`` fixed bytes (the framer's fixed part) the target
        region its data goes straight into."""
        layout = flat_layout(payload.schema)
        slots = layout.slots()
        flag_field = self.protocol.cache_rule.flag_field
        # No such field in this version's request: the flag reads as 0, as a dict .get(name, 0) would.
        flag = slots[flag_field][0] if flag_field in slots else -1
        unpack_from, tensor, offset = layout.struct.unpack_from, slots["tensor"][0], slots["offset"][0]

        def check(size: int) -> None:
            if size < head_size:
                raise Close(f"SET_TENSOR size {size} below its {head_size}-byte header{_upstream('close')}")
            if size >= _SIZE_LIMIT:
                raise Close(f"SET_TENSOR size {size} >= 2^63{_upstream('process abort, uncaught length error')}")

        def start(size: int, data: Any, at: int) -> memoryview | Bulk | None:
            f = unpack_from(data, at)
            n = size - head_size
            t = self._flat_tensor(f, tensor, "SET_TENSOR")
            # Checked before a single payload byte is taken: nothing is received that does not fit its target.
            region = self._region(t, f[offset], n, "SET_TENSOR")
            if n == 0:
                return None
            t.buffer.epoch += 1  # type: ignore[union-attr]  # _region checked it; bumped before a byte lands
            cache = self.cache
            if cache is None or not self.protocol.cache_rule.server_saves(n, f[flag] if flag >= 0 else 0):
                return region
            cache.begin_save()
            return Bulk([region], done=lambda: cache.save(region), cleanup=cache.end_save)

        return head_size, check, start

    def _set_tensor_hash_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        digest = f[slots["hash"][0]]
        # Upstream answers a miss without looking at the tensor at all.
        n = self.cache.entry_size(digest) if self.cache is not None else None
        if n is None and self.cache is not None and self.cache.wait_for_saves(_SAVE_WAIT):
            n = self.cache.entry_size(digest)  # another connection was saving: maybe this very entry
        if n is None:
            self.reply(Command.SET_TENSOR_HASH, {"result": 0})
            return
        t = self._flat_tensor(f, slots["tensor"][0], "SET_TENSOR_HASH")
        region = self._region(t, f[slots["offset"][0]], n, "SET_TENSOR_HASH")
        t.buffer.epoch += 1  # type: ignore[union-attr]  # a hit writes the region (a miss may have, see load_into)
        if self.cache is None or not self.cache.load_into(digest, region):
            self.reply(Command.SET_TENSOR_HASH, {"result": 0})
            return
        self.reply(Command.SET_TENSOR_HASH, {"result": 1})

    def _get_tensor(self, f: dict[str, Any]) -> None:
        """GET_TENSOR from the decoded dict: for replacement handlers that call it (the server uses the flat one)."""
        t = self._tensor(f["tensor"], "GET_TENSOR")
        size = f["size"]
        region = self._region(t, f["offset"], size, "GET_TENSOR")
        self._send_data(REPLY_HEADER.pack(size), region)

    def _get_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self._flat_tensor(f, slots["tensor"][0], "GET_TENSOR")
        size = f[slots["size"][0]]
        region = self._region(t, f[slots["offset"][0]], size, "GET_TENSOR")
        self._send_data(REPLY_HEADER.pack(size), region)

    def _memset_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self._flat_tensor(f, slots["tensor"][0], "MEMSET_TENSOR")
        if t.buffer is None:
            raise Close(f"MEMSET_TENSOR: tensor has no buffer (null or unknown handle){_upstream('close')}")
        offset, size, nbytes = f[slots["offset"][0]], f[slots["size"][0]], t.nbytes
        if offset > nbytes or size > nbytes - offset:
            raise Close(f"MEMSET_TENSOR: region offset {offset} + {size} outside the tensor's {nbytes} bytes"
                        f"{_upstream('close')}")
        buf = t.buffer
        rel = t.data - buf.base
        if rel < 0 or rel > buf.size or offset > buf.size - rel or size > buf.size - rel - offset:
            raise Close(f"MEMSET_TENSOR: region outside the buffer{_upstream('close')}")
        if size == 0:
            return
        if buf.size == 0:
            raise Close(f"MEMSET_TENSOR on a zero-size buffer, which has no memset{_upstream('close')}")
        buf.epoch += 1
        buf.memory[rel + offset : rel + offset + size] = f[slots["value"][0]]

    def _copy_tensor(self, f: dict[str, Any]) -> None:
        src = self._tensor(f["src"], "COPY_TENSOR", "src")
        dst = self._tensor(f["dst"], "COPY_TENSOR", "dst")
        if src.buffer is None or dst.buffer is None:
            raise Close(f"COPY_TENSOR: src or dst has no buffer{_upstream('close')}")
        n = src.nbytes
        d = dst.data
        if dst.buffer.size == 0:
            # Upstream allocates a zero-size buffer as a dummy without a copy function: the copy is declined
            # (result 0), not failed, even when there is nothing to copy.
            self.reply(Command.COPY_TENSOR, {"result": 0})
            return
        if d + n > dst.buffer.end:
            raise Close(f"COPY_TENSOR: {n} bytes from dst data {d:#x} run past the dst buffer end "
                        f"{dst.buffer.end:#x}{_upstream('close')}")
        s_off = src.data - src.buffer.base
        d_off = d - dst.buffer.base
        dst.buffer.epoch += 1
        # numpy copies overlapping ranges correctly (memmove semantics).
        np.copyto(dst.buffer.memory[d_off : d_off + n], src.buffer.memory[s_off : s_off + n])
        self.reply(Command.COPY_TENSOR, {"result": 1})

    def _init_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self._flat_tensor(f, slots["tensor"][0], "INIT_TENSOR")
        if t.buffer is None:
            # Upstream logs and carries on; the CPU backend has nothing to initialise.
            log.info("%s: INIT_TENSOR of a tensor without buffer (ignored, as upstream)", self.name)

    def _get_alloc_size_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        self._device(f[slots["device"][0]], "GET_ALLOC_SIZE")
        t = self._flat_tensor(f, slots["tensor"][0], "GET_ALLOC_SIZE")
        first, width = slots["srcs"]
        step = _TENSOR.width
        for i, start in enumerate(range(first, first + width, step)):
            # Upstream silently drops a src of an invalid type; data outside its buffer is an abort there.
            stype = f[start + _T_TYPE]
            if f[start + _T_ID] != 0 and stype < GGML_TYPE_COUNT and not TYPES[stype].removed:
                self._flat_tensor(f, start, "GET_ALLOC_SIZE", f"srcs[{i}]")
        # CPU buffer types allocate exactly ggml_nbytes, a size_t upstream: it wraps past 2^64 rather than fail.
        self.reply(Command.GET_ALLOC_SIZE, {"alloc_size": t.nbytes & U64_MASK})

    def _supports_op(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_DEVICE_SUPPORTS_OP")
        op = self._tensor(f["op"], "GET_DEVICE_SUPPORTS_OP", "op")
        srcs = [self._tensor(s, "GET_DEVICE_SUPPORTS_OP", f"srcs[{i}]") if s["id"] else None
                for i, s in enumerate(f["srcs"])]
        self.reply(Command.GET_DEVICE_SUPPORTS_OP, {"supported": int(self._executor_supports(op, srcs))})

