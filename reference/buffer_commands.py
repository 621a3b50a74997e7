"""The reference connection's buffer and device commands, as a handler table (:attr:`BufferCommands.handlers`,
:attr:`BufferCommands.flat`) over what the group is given: the connection's buffer table, resolver and reply queue,
and what a FREE_BUFFER must tell the stored graphs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ggml_rpc.spec import Command

from .closing import FlatHandler
from .config import ServerConfig
from .devices import BufferTable
from .replies import Replies
from .resolve import Resolver

log = logging.getLogger("ggml_rpc.reference")


class BufferCommands:
    """ALLOC_BUFFER, FREE_BUFFER, BUFFER_GET_BASE, BUFFER_CLEAR, GET_ALIGNMENT, GET_MAX_SIZE, GET_DEVICE_MEMORY and
    DEVICE_COUNT."""

    def __init__(self, config: ServerConfig, table: BufferTable, resolve: Resolver, out: Replies, *,
                 freed: Callable[[int], None], name: str) -> None:
        self.config = config
        self.table = table
        self.resolve = resolve
        self.out = out
        #: Told the handle of every buffer a FREE_BUFFER frees, before it goes (the stored graphs forget it).
        self.freed = freed
        self.name = name
        # Replies that never change on a connection, encoded once.
        device = config.device
        self._alignment = self._prepared(Command.GET_ALIGNMENT, {"alignment": device.alignment})
        self._max_size = self._prepared(Command.GET_MAX_SIZE, {"max_size": device.max_size})
        self._device_count = self._prepared(Command.DEVICE_COUNT, {"device_count": config.devices})
        self.handlers: dict[Command, Callable[[dict[str, Any]], None]] = {
            Command.ALLOC_BUFFER: self.alloc_buffer,
            Command.GET_ALIGNMENT: self.get_alignment,
            Command.GET_MAX_SIZE: self.get_max_size,
            Command.BUFFER_GET_BASE: self.buffer_get_base,
            Command.FREE_BUFFER: self.free_buffer,
            Command.BUFFER_CLEAR: self.buffer_clear,
            Command.GET_DEVICE_MEMORY: self.get_device_memory,
            Command.DEVICE_COUNT: self.device_count,
        }
        self.flat: dict[Command, FlatHandler] = {
            Command.GET_ALIGNMENT: self.get_alignment_flat,
            Command.GET_MAX_SIZE: self.get_max_size_flat,
        }

    def _prepared(self, command: Command, fields: dict[str, Any]) -> Callable[[], None]:
        """Queues the reply of ``command`` with ``fields``: encoded once when its reply is fixed-size."""
        encoded = self.out.encoded(command, fields)
        if encoded is None:  # a version whose reply is not fixed-size (none today): encode it each time
            return lambda: self.out.reply(command, fields)
        return lambda: self.out.push(encoded)

    def alloc_buffer(self, f: dict[str, Any]) -> None:
        device = self.resolve.device(f["device"], "ALLOC_BUFFER")
        buf = self.table.alloc(device, f["size"])
        if buf is None:
            log.info("%s: ALLOC_BUFFER of %d bytes on device %d refused (free %d): remote_ptr 0", self.name,
                     f["size"], device, self.table.devices[device].free)
            self.out.reply(Command.ALLOC_BUFFER, {"remote_ptr": 0, "remote_size": 0})
        else:
            self.out.reply(Command.ALLOC_BUFFER, {"remote_ptr": buf.handle, "remote_size": buf.size})

    def get_alignment(self, f: dict[str, Any]) -> None:
        self.resolve.device(f["device"], "GET_ALIGNMENT")
        self._alignment()

    def get_alignment_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        # The busiest small command a client sends: one comparison and one prepared send.
        device = f[slots["device"][0]]
        if device >= self.config.devices:
            self.resolve.device(device, "GET_ALIGNMENT")
        self._alignment()

    def get_max_size(self, f: dict[str, Any]) -> None:
        self.resolve.device(f["device"], "GET_MAX_SIZE")
        self._max_size()

    def get_max_size_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        device = f[slots["device"][0]]
        if device >= self.config.devices:
            self.resolve.device(device, "GET_MAX_SIZE")
        self._max_size()

    def get_device_memory(self, f: dict[str, Any]) -> None:
        dev = self.table.devices[self.resolve.device(f["device"], "GET_DEVICE_MEMORY")]
        self.out.reply(Command.GET_DEVICE_MEMORY, {"free_mem": dev.free, "total_mem": dev.config.memory})

    def device_count(self, f: dict[str, Any]) -> None:
        self._device_count()

    def buffer_get_base(self, f: dict[str, Any]) -> None:
        buf = self.resolve.buffer(f["remote_ptr"], "BUFFER_GET_BASE")
        self.out.reply(Command.BUFFER_GET_BASE, {"base_ptr": buf.base})

    def free_buffer(self, f: dict[str, Any]) -> None:
        buf = self.resolve.buffer(f["remote_ptr"], "FREE_BUFFER")
        self.freed(buf.handle)
        self.table.free(buf.handle)

    def buffer_clear(self, f: dict[str, Any]) -> None:
        buf = self.resolve.buffer(f["remote_ptr"], "BUFFER_CLEAR")
        buf.write_array().fill(f["value"])


__all__ = ["BufferCommands"]
