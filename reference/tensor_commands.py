"""The reference connection's tensor commands: SET/GET/MEMSET/COPY_TENSOR, SET_TENSOR_HASH, INIT_TENSOR,
GET_ALLOC_SIZE and GET_DEVICE_SUPPORTS_OP, as a handler table (:attr:`TensorCommands.handlers`) over what the group
is given: the connection's resolver, reply queue and hash cache (an :class:`~.effects.EntryCache`; what would block,
finding, reading and writing entries, is yielded as an effect of :mod:`.effects` for the I/O module to carry out).

Hot commands read the flat tuple of their request's derived layout (``*_flat`` handlers) instead of a nested dict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from ggml_rpc.spec import Command, Payload, Protocol
from ggml_rpc.spec.codec import REPLY_HEADER
from ggml_rpc.spec.conditions import region_past, removed_type, unknown_type
from ggml_rpc.spec.layout import flat_layout

from .closing import SIZE_LIMIT, BulkDestination, Close, FlatHandler, Headed, Receiver
from .closing import upstream as _upstream
from .devices import U64_MASK
from .effects import EntryCache, FindEntry, LoadEntry, SaveEntry
from .graph_commands import executor_supports
from .replies import Replies
from .resolve import T_ID, T_TYPE, TENSOR_LAYOUT, Resolver

log = logging.getLogger("ggml_rpc.reference")

#: Longest a SET_TENSOR_HASH miss waits for saves under way on other connections (--concurrent only).
_SAVE_WAIT = 5.0


class TensorCommands:
    """Tensor-data commands over one connection's resolver, reply queue and (when the server has one) hash cache."""

    def __init__(self, protocol: Protocol, cache: EntryCache | None, resolve: Resolver, out: Replies, *,
                 name: str) -> None:
        self.protocol = protocol
        self.cache = cache
        self.resolve = resolve
        self.out = out
        self.name = name
        #: Handlers taking the decoded fields (the server's dispatch prefers :attr:`flat` where both exist).
        self.handlers: dict[Command, Callable[[dict[str, Any]], None]] = {
            Command.COPY_TENSOR: self.copy_tensor,
            Command.GET_TENSOR: self.get_tensor,
            Command.GET_DEVICE_SUPPORTS_OP: self.supports_op,
        }
        self.flat: dict[Command, FlatHandler] = {
            Command.GET_TENSOR: self.get_tensor_flat,
            Command.SET_TENSOR_HASH: self.set_tensor_hash_flat,
            Command.MEMSET_TENSOR: self.memset_tensor_flat,
            Command.INIT_TENSOR: self.init_tensor_flat,
            Command.GET_ALLOC_SIZE: self.get_alloc_size_flat,
        }

    # ---- tensor data -----------------------------------------------------------------------------------------

    def set_tensor_runner(self, payload: Payload, head_size: int) -> Headed:
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
            if size >= SIZE_LIMIT:
                raise Close(f"SET_TENSOR size {size} >= 2^63{_upstream('process abort, uncaught length error')}")

        def start(size: int, data: Any, at: int) -> memoryview | BulkDestination | None:
            f = unpack_from(data, at)
            n = size - head_size
            t = self.resolve.flat_tensor(f, tensor, "SET_TENSOR")
            # Checked before a single payload byte is taken: nothing is received that does not fit its target (which
            # is marked written before a byte lands).
            region = self.resolve.region(t, f[offset], n, "SET_TENSOR", write=n > 0)
            if n == 0:
                return None
            cache = self.cache
            if cache is None or not self.protocol.cache_rule.server_saves(n, f[flag] if flag >= 0 else 0):
                return region
            cache.begin_save()
            return BulkDestination([region], then=SaveEntry(region), cleanup=cache.end_save)

        return head_size, check, start

    def set_tensor_hash_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> Receiver | None:
        if self.cache is None:
            self.out.reply(Command.SET_TENSOR_HASH, {"result": 0})
            return None
        return self._from_cache(f, slots)

    def _from_cache(self, f: tuple, slots: dict[str, tuple[int, int]]) -> Receiver:
        """SET_TENSOR_HASH with a cache: the entry found, then read into the tensor, both by the I/O module."""
        digest = f[slots["hash"][0]]
        # A miss waits for saves under way on other connections (maybe of this very entry).
        n = yield FindEntry(digest, _SAVE_WAIT)
        if n is None:  # upstream answers a miss without looking at the tensor at all
            self.out.reply(Command.SET_TENSOR_HASH, {"result": 0})
            return
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "SET_TENSOR_HASH")
        # Marked written: a hit writes the region, and a miss may have (see HashCache.load_into).
        region = self.resolve.region(t, f[slots["offset"][0]], n, "SET_TENSOR_HASH", write=True)
        hit = yield LoadEntry(digest, region)
        self.out.reply(Command.SET_TENSOR_HASH, {"result": 1 if hit else 0})

    def get_tensor(self, f: dict[str, Any]) -> None:
        """GET_TENSOR from the decoded dict: for replacement handlers that call it (the server uses the flat one)."""
        t = self.resolve.tensor(f["tensor"], "GET_TENSOR")
        size = f["size"]
        region = self.resolve.region(t, f["offset"], size, "GET_TENSOR")
        self.out.send_data(REPLY_HEADER.pack(size), region)

    def get_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "GET_TENSOR")
        size = f[slots["size"][0]]
        region = self.resolve.region(t, f[slots["offset"][0]], size, "GET_TENSOR")
        self.out.send_data(REPLY_HEADER.pack(size), region)

    def memset_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "MEMSET_TENSOR")
        if t.buffer is None:
            raise Close(f"MEMSET_TENSOR: tensor has no buffer (null or unknown handle){_upstream('close')}")
        offset, size, nbytes = f[slots["offset"][0]], f[slots["size"][0]], t.nbytes
        if region_past(offset, size, nbytes):
            raise Close(f"MEMSET_TENSOR: region offset {offset} + {size} outside the tensor's {nbytes} bytes"
                        f"{_upstream('close')}", "REGION-PAST-TENSOR")
        if offset > nbytes:  # upstream refuses an empty region past the end too; the table does not
            raise Close(f"MEMSET_TENSOR: offset {offset} past the tensor's {nbytes} bytes{_upstream('close')}")
        buf = t.buffer
        rel = t.data - buf.base
        if rel < 0 or rel > buf.size or offset > buf.size - rel or size > buf.size - rel - offset:
            raise Close(f"MEMSET_TENSOR: region outside the buffer{_upstream('close')}")
        if size == 0:
            return
        if buf.size == 0:
            raise Close(f"MEMSET_TENSOR on a zero-size buffer, which has no memset{_upstream('close')}")
        buf.write_array(rel + offset, size)[:] = f[slots["value"][0]]

    def copy_tensor(self, f: dict[str, Any]) -> None:
        src = self.resolve.tensor(f["src"], "COPY_TENSOR", "src")
        dst = self.resolve.tensor(f["dst"], "COPY_TENSOR", "dst")
        if src.buffer is None or dst.buffer is None:
            raise Close(f"COPY_TENSOR: src or dst has no buffer{_upstream('close')}")
        n = src.nbytes
        d = dst.data
        if dst.buffer.size == 0:
            # Upstream allocates a zero-size buffer as a dummy without a copy function: the copy is declined
            # (result 0), not failed, even when there is nothing to copy.
            self.out.reply(Command.COPY_TENSOR, {"result": 0})
            return
        if d + n > dst.buffer.end:
            raise Close(f"COPY_TENSOR: {n} bytes from dst data {d:#x} run past the dst buffer end "
                        f"{dst.buffer.end:#x}{_upstream('close')}")
        s_off = src.data - src.buffer.base
        d_off = d - dst.buffer.base
        # numpy copies overlapping ranges correctly (memmove semantics).
        np.copyto(dst.buffer.write_array(d_off, n), src.buffer.memory[s_off : s_off + n])
        self.out.reply(Command.COPY_TENSOR, {"result": 1})

    def init_tensor_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "INIT_TENSOR")
        if t.buffer is None:
            # Upstream logs and carries on; the CPU backend has nothing to initialise.
            log.info("%s: INIT_TENSOR of a tensor without buffer (ignored, as upstream)", self.name)

    def get_alloc_size_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        self.resolve.device(f[slots["device"][0]], "GET_ALLOC_SIZE")
        t = self.resolve.flat_tensor(f, slots["tensor"][0], "GET_ALLOC_SIZE")
        first, width = slots["srcs"]
        step = TENSOR_LAYOUT.width
        for i, start in enumerate(range(first, first + width, step)):
            # Upstream silently drops a src of an invalid type; data outside its buffer is an abort there.
            stype = f[start + T_TYPE]
            if f[start + T_ID] != 0 and not unknown_type(stype) and not removed_type(stype):
                self.resolve.flat_tensor(f, start, "GET_ALLOC_SIZE", f"srcs[{i}]")
        # CPU buffer types allocate exactly ggml_nbytes, a size_t upstream: it wraps past 2^64 rather than fail.
        self.out.reply(Command.GET_ALLOC_SIZE, {"alloc_size": t.nbytes & U64_MASK})

    def supports_op(self, f: dict[str, Any]) -> None:
        self.resolve.device(f["device"], "GET_DEVICE_SUPPORTS_OP")
        op = self.resolve.tensor(f["op"], "GET_DEVICE_SUPPORTS_OP", "op")
        srcs = [self.resolve.tensor(s, "GET_DEVICE_SUPPORTS_OP", f"srcs[{i}]") if s["id"] else None
                for i, s in enumerate(f["srcs"])]
        self.out.reply(Command.GET_DEVICE_SUPPORTS_OP, {"supported": int(executor_supports(op, srcs, self.name))})


__all__ = ["TensorCommands"]
