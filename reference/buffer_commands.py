"""The reference connection's buffer and device commands (a mixin of :class:`.core.ServerCore`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ggml_rpc.spec import Command

from .closing import Close
from .closing import upstream as _upstream
from .devices import Buffer

log = logging.getLogger("ggml_rpc.reference")


class BufferCommands:
    """ALLOC_BUFFER, FREE_BUFFER, BUFFER_GET_BASE, BUFFER_CLEAR, GET_ALIGNMENT, GET_MAX_SIZE, GET_DEVICE_MEMORY and
    DEVICE_COUNT."""

    def _device(self, device: int, command: str) -> int:
        if device >= self.config.devices:
            raise Close(f"{command}: device {device} >= device count {self.config.devices}{_upstream('close')}")
        return device

    def _buffer(self, handle: int, command: str) -> Buffer:
        buf = self.table.get(handle)
        if buf is None:
            raise Close(f"{command}: unknown buffer handle {handle:#x}{_upstream('close')}")
        return buf

    def _alloc_buffer(self, f: dict[str, Any]) -> None:
        device = self._device(f["device"], "ALLOC_BUFFER")
        buf = self.table.alloc(device, f["size"])
        if buf is None:
            log.info("%s: ALLOC_BUFFER of %d bytes on device %d refused (free %d): remote_ptr 0", self.name,
                     f["size"], device, self.table.devices[device].free)
            self.reply(Command.ALLOC_BUFFER, {"remote_ptr": 0, "remote_size": 0})
        else:
            self.reply(Command.ALLOC_BUFFER, {"remote_ptr": buf.handle, "remote_size": buf.size})

    def _get_alignment(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_ALIGNMENT")
        self._send_fixed(Command.GET_ALIGNMENT, self._alignment_reply, {"alignment": self.config.device.alignment})

    def _get_alignment_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        # The busiest small command a client sends: one comparison and one prepared send.
        device = f[slots["device"][0]]
        if device >= self.config.devices:
            self._device(device, "GET_ALIGNMENT")
        self._send_fixed(Command.GET_ALIGNMENT, self._alignment_reply, {"alignment": self.config.device.alignment})

    def _get_max_size_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        device = f[slots["device"][0]]
        if device >= self.config.devices:
            self._device(device, "GET_MAX_SIZE")
        self._send_fixed(Command.GET_MAX_SIZE, self._max_size_reply, {"max_size": self.config.device.max_size})

    def _get_max_size(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_MAX_SIZE")
        self._send_fixed(Command.GET_MAX_SIZE, self._max_size_reply, {"max_size": self.config.device.max_size})

    def _send_fixed(self, command: Command, encoded: bytes | None, fields: Mapping[str, Any]) -> None:
        if encoded is None:  # a version whose reply is not fixed-size (none today): encode it each time
            self.reply(command, fields)
        else:
            self._out.append(encoded)

    def _get_device_memory(self, f: dict[str, Any]) -> None:
        dev = self.table.devices[self._device(f["device"], "GET_DEVICE_MEMORY")]
        self.reply(Command.GET_DEVICE_MEMORY, {"free_mem": dev.free, "total_mem": dev.config.memory})

    def _device_count(self, f: dict[str, Any]) -> None:
        self._send_fixed(Command.DEVICE_COUNT, self._device_count_reply, {"device_count": self.config.devices})

    def _buffer_get_base(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "BUFFER_GET_BASE")
        self.reply(Command.BUFFER_GET_BASE, {"base_ptr": buf.base})

    def _free_buffer(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "FREE_BUFFER")
        if self.protocol.graph_cache_max is not None:
            # 8.0.0 forgets every stored graph on any FREE_BUFFER, keeping their uids (they still count towards
            # GRAPH_CACHE_MAX): a GRAPH_RECOMPUTE after it closes, a GRAPH_COMPUTE under the uid rebuilds.
            self.graphs = dict.fromkeys(self.graphs)
        else:
            # Upstream 6/7 keeps stored graphs that point into the freed buffer (a use-after-free on RECOMPUTE).
            for key, graph in list(self.graphs.items()):
                if graph is not None and buf.handle in graph.buffers:
                    del self.graphs[key]
                    log.info("%s: FREE_BUFFER %#x drops the stored graph of device %d", self.name, buf.handle,
                             key[0])
        self.table.free(buf.handle)

    def _buffer_clear(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "BUFFER_CLEAR")
        buf.epoch += 1
        buf.memory.fill(f["value"])

