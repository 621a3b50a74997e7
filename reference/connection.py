"""One client connection of the reference server: HELLO, then one command at a time, as upstream serves them.

Every request is checked the way upstream checks it (protocol.md §6).  Where upstream closes the connection, this
closes it; where upstream aborts the process, crashes or is unsafe, this closes only the connection and logs one
line naming the rule, then the server goes on serving.  There is never an error reply: the protocol has none.

Sizes are claims.  A SET_TENSOR is checked against its target region before its payload is read, and the payload
is then received straight into the buffer's memory; a GRAPH_COMPUTE payload is bounded and read as it arrives.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ggml_rpc.spec import (
    NEVER_ON_WIRE,
    TYPES,
    V7,
    Command,
    Payload,
    Protocol,
    ProtocolError,
    encode_reply,
    ggml_nbytes,
    hello_reply,
    tensor_name,
    type_name,
)
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER, REQUEST_HEADER_SIZE, decode_payload
from ggml_rpc.spec.enums import GGML_TYPE_COUNT
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.messages import Shape
from ggml_rpc.spec.tensor import RpcTensor

from .cache import HashCache
from .devices import U64_MASK, Buffer, BufferTable, DeviceConfig
from .graph import BuiltGraph, ExecutorError, GraphError, GraphTensor, build_graph

log = logging.getLogger("ggml_rpc.reference")

#: A GRAPH_COMPUTE payload larger than this is refused (upstream: whatever the allocator gives).
DEFAULT_MAX_GRAPH_BYTES = 256 << 20
_GRAPH_CHUNK = 1 << 20
_SIZE_LIMIT = 1 << 63  # upstream: a length error it does not catch (process abort)
#: Tensor sizes remembered per connection (the memo is emptied when full).
_NBYTES_REMEMBERED = 4096
#: Longest a SET_TENSOR_HASH miss waits for saves under way on other connections (--concurrent only).
_SAVE_WAIT = 5.0


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is started with; connections share nothing else but the cache."""

    protocol: Protocol = V7
    devices: int = 1
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache_dir: str | None = None
    cache_max_bytes: int | None = None
    concurrent: bool = False
    verbose: bool = False
    max_graph_bytes: int = DEFAULT_MAX_GRAPH_BYTES
    #: Runs a rebuilt graph (None: the built-in executor, a plan ``prepare``d once per graph and run again).
    executor: Callable[[list[GraphTensor]], None] | None = None
    #: Threads numpy's BLAS may use for graph computation (upstream rpc-server's ``-t``).  One by default: on a busy
    #: machine OpenBLAS's worker threads wait for a core, and a 32,000 x 256 F32 matrix-vector product took 10-15 ms
    #: instead of 1 ms (2 cores, the client and other work running).  None leaves the process's setting alone.
    threads: int | None = 1


class Close(Exception):
    """End this connection without a reply; the message names the rule and what upstream does."""


class PeerGone(Exception):
    """The client closed or reset the connection."""


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


def _upstream(text: str) -> str:
    return f" (upstream: {text})"


class Connection:
    """Serves one accepted socket until the client leaves or a rule closes it."""

    def __init__(
        self,
        sock: socket.socket,
        config: ServerConfig,
        cache: HashCache | None,
        *,
        name: str = "conn",
    ) -> None:
        self.sock = sock
        self.config = config
        self.protocol = config.protocol
        self.cache = cache
        self.name = name
        self.table = BufferTable.for_devices(config.devices, config.device)
        self.graphs: dict[int, BuiltGraph] = {}
        #: GRAPH_COMPUTE payloads are received here (grown as bytes arrive, reused by the next one).
        self._graph_buf = bytearray()
        self.commands = 0
        self._executor = config.executor
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._handlers: dict[Command, Callable[[dict[str, Any]], None]] = {
            Command.ALLOC_BUFFER: self._alloc_buffer,
            Command.GET_ALIGNMENT: self._get_alignment,
            Command.GET_MAX_SIZE: self._get_max_size,
            Command.BUFFER_GET_BASE: self._buffer_get_base,
            Command.FREE_BUFFER: self._free_buffer,
            Command.BUFFER_CLEAR: self._buffer_clear,
            Command.COPY_TENSOR: self._copy_tensor,
            Command.GET_TENSOR: self._get_tensor,
            Command.GET_DEVICE_MEMORY: self._get_device_memory,
            Command.DEVICE_COUNT: self._device_count,
            Command.GRAPH_RECOMPUTE: self._graph_recompute,
            Command.GET_DEVICE_SUPPORTS_OP: self._supports_op,
        }
        self._verbose = config.verbose
        self._nbytes: dict[tuple, int] = {}
        # A subclass that checks tensors its own way (test variants do) gets every tensor as the dict it expects.
        self._tensor_hooked = self._overrides("_tensor")
        self._read_buffered = self._rfile.read
        # Fixed-size replies, packed straight from their derived layout.
        self._reply_layouts: dict[Command, Any] = {
            cmd: flat_layout(spec.reply.schema)
            for cmd, spec in self.protocol.commands.items()
            if isinstance(spec.reply, Payload) and spec.reply.shape is Shape.FIXED
        }
        # Replies that never change on a connection, encoded once.
        self._alignment_reply = self._encoded_reply(Command.GET_ALIGNMENT, {"alignment": config.device.alignment})
        self._max_size_reply = self._encoded_reply(Command.GET_MAX_SIZE, {"max_size": config.device.max_size})
        self._device_count_reply = self._encoded_reply(Command.DEVICE_COUNT, {"device_count": config.devices})
        # Hot handlers that read the flat tuple of the request's derived layout instead of a nested dict.
        # A subclass that replaces the dict-based GET_TENSOR handler (test variants do) keeps it.
        flat_handlers: dict[Command, Callable[[tuple, dict[str, tuple[int, int]]], None]] = {
            Command.GET_TENSOR: self._get_tensor_flat,
        } if not self._overrides("_get_tensor") else {}
        flat_handlers |= {
            Command.SET_TENSOR_HASH: self._set_tensor_hash_flat,
            Command.MEMSET_TENSOR: self._memset_tensor_flat,
            Command.INIT_TENSOR: self._init_tensor_flat,
            Command.GET_ALLOC_SIZE: self._get_alloc_size_flat,
        }
        # Per command id of this version (HELLO excepted): (command, exact size or -1 when variable, runner).
        # A fixed-size runner takes the payload bytes, a variable-size one the claimed size.
        self._dispatch: dict[int, tuple[Command, int, Callable[[Any], None]]] = {}
        for cmd, spec in self.protocol.commands.items():
            if cmd is Command.HELLO or cmd in NEVER_ON_WIRE:
                continue
            req = spec.request
            if req.shape is Shape.FIXED:
                self._dispatch[int(cmd)] = (cmd, req.header_size, self._fixed_runner(cmd, req, flat_handlers))
            elif cmd is Command.SET_TENSOR:
                self._dispatch[int(cmd)] = (cmd, -1, self._set_tensor_runner(req))
            elif cmd is Command.GRAPH_COMPUTE:
                self._dispatch[int(cmd)] = (cmd, -1, lambda size, req=req: self._graph_compute(req, size))
            else:  # pragma: no cover - every shape of every version is handled above
                self._dispatch[int(cmd)] = (cmd, -1, lambda size, name=cmd.name: self._no_handler(name))

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(Connection, name)

    def _fixed_runner(self, cmd: Command, req: Payload, flat_handlers: Mapping) -> Callable[[bytes], None]:
        layout = flat_layout(req.schema)
        flat = flat_handlers.get(cmd)
        if flat is not None:
            unpack, slots = layout.struct.unpack, layout.slots()
            return lambda body: flat(unpack(body), slots)
        handler, unpack_dict = self._handlers[cmd], layout.unpack
        return lambda body: handler(unpack_dict(body) if body else {})

    @staticmethod
    def _no_handler(name: str) -> None:
        raise Close(f"{name}: no handler")

    def _encoded_reply(self, command: Command, fields: Mapping[str, Any]) -> bytes | None:
        layout = self._reply_layouts.get(command)
        if layout is None:
            return None
        body = layout.pack(fields)
        return REPLY_HEADER.pack(len(body)) + body

    # ---- socket I/O ------------------------------------------------------------------------------------------

    def _read(self, n: int) -> bytes:
        data = self._rfile.read(n) if n else b""
        if len(data) != n:
            raise PeerGone(f"client closed the connection inside a message ({len(data)} of {n} bytes)")
        return data

    def _read_into(self, view: memoryview) -> None:
        got = 0
        total = view.nbytes
        while got < total:
            n = self._rfile.readinto(view[got:])
            if not n:
                raise PeerGone(f"client closed the connection inside a payload ({got} of {total} bytes)")
            got += n

    def _send_data(self, head: bytes, data: memoryview) -> None:
        """A reply header and its bulk bytes: one sendmsg when the socket takes them all (the usual case)."""
        sent = self.sock.sendmsg((head, data))
        if sent < len(head):
            self._send([head[sent:], data])
        elif sent < len(head) + data.nbytes:
            self._send([data[sent - len(head):]])

    def _send(self, parts: list) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        while views:
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _reply(self, command: Command, fields: Mapping[str, Any]) -> None:
        encoded = self._encoded_reply(command, fields)
        self.sock.sendall(encode_reply(self.protocol, command, fields) if encoded is None else encoded)

    # ---- the loop --------------------------------------------------------------------------------------------

    def serve(self) -> str:
        """Serve until the connection ends; returns the reason (also logged)."""
        try:
            self._handshake()
            while True:
                self._one_command()
        except PeerGone as exc:
            reason = str(exc)
        except Close as exc:
            reason = f"closed: {exc}"
        except (ConnectionResetError, BrokenPipeError) as exc:
            reason = f"client reset the connection ({exc.strerror or exc})"
        except OSError as exc:
            reason = f"socket error: {exc}"
        except Exception as exc:  # a bug here must cost one connection, never the server
            log.debug("%s: internal error", self.name, exc_info=True)
            reason = f"closed: internal error {type(exc).__name__}: {exc}"
        finally:
            self._release()
        return reason

    def _release(self) -> None:
        self.graphs.clear()
        self.table.release_all()
        try:
            self._rfile.close()
        except OSError:
            pass

    def _handshake(self) -> None:
        first = self._rfile.read(1)
        if not first:
            raise PeerGone("client closed the connection before HELLO")
        if first[0] != Command.HELLO:
            raise Close(f"first command is {first[0]}, not HELLO ({int(Command.HELLO)})"
                        f"{_upstream('close, Expected HELLO command')}")
        _, size = REQUEST_HEADER.unpack(first + self._read(REQUEST_HEADER_SIZE - 1))
        expected = self.protocol.commands[Command.HELLO].request.header_size
        if size != expected:
            raise Close(f"HELLO size {size}, not {expected}{_upstream('close')}")
        self._read(size)  # the client's caps: a plain-TCP server ignores them
        self.sock.sendall(encode_reply(self.protocol, Command.HELLO, hello_reply(self.protocol.version)))
        self.commands += 1
        if self.config.verbose:
            log.info("%s: HELLO -> %s", self.name, self.protocol.label)

    def _one_command(self) -> None:
        header = self._read_buffered(REQUEST_HEADER_SIZE)
        if len(header) != REQUEST_HEADER_SIZE:
            if not header:
                raise PeerGone("client closed the connection")
            raise PeerGone(f"client closed the connection inside a request header ({len(header)} of "
                           f"{REQUEST_HEADER_SIZE} bytes)")
        cmd, size = REQUEST_HEADER.unpack(header)
        self.commands += 1
        entry = self._dispatch.get(cmd)
        if entry is None:
            if cmd == Command.HELLO:
                raise Close(f"HELLO after the handshake{_upstream('close')}")
            raise Close(f"unknown command {cmd} in protocol {self.protocol.label}{_upstream('close')}")
        command, want, run = entry
        if self._verbose:
            log.info("%s: %s size=%d", self.name, command.name, size)
        if want < 0:
            run(size)
        elif size != want:
            raise Close(f"{command.name} size {size}, not {want}{_upstream('close, payload unread')}")
        elif size:
            body = self._read_buffered(size)
            if len(body) != size:
                raise PeerGone(f"client closed the connection inside a message ({len(body)} of {size} bytes)")
            run(body)
        else:
            run(b"")

    # ---- shared checks ---------------------------------------------------------------------------------------

    def _device(self, device: int, command: str) -> int:
        if device >= self.config.devices:
            raise Close(f"{command}: device {device} >= device count {self.config.devices}{_upstream('close')}")
        return device

    def _buffer(self, handle: int, command: str) -> Buffer:
        buf = self.table.get(handle)
        if buf is None:
            raise Close(f"{command}: unknown buffer handle {handle:#x}{_upstream('close')}")
        return buf

    def _tensor(self, t: Mapping[str, Any], command: str, what: str = "tensor") -> _Tensor:
        """deserialize_tensor of a decoded tensor dict (see :meth:`_checked`)."""
        return self._checked(t["type"], tuple(t["ne"]), tuple(t["nb"]), t["buffer"], t["data"], t, command, what)

    def _flat_tensor(self, flat: tuple, start: int, command: str, what: str = "tensor") -> _Tensor:
        """deserialize_tensor of the rpc_tensor at ``start`` in a request's flat tuple (see :meth:`_checked`)."""
        if self._tensor_hooked:
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

    # ---- buffers and devices ---------------------------------------------------------------------------------

    def _alloc_buffer(self, f: dict[str, Any]) -> None:
        device = self._device(f["device"], "ALLOC_BUFFER")
        buf = self.table.alloc(device, f["size"])
        if buf is None:
            log.info("%s: ALLOC_BUFFER of %d bytes on device %d refused (free %d): remote_ptr 0", self.name,
                     f["size"], device, self.table.devices[device].free)
            self._reply(Command.ALLOC_BUFFER, {"remote_ptr": 0, "remote_size": 0})
        else:
            self._reply(Command.ALLOC_BUFFER, {"remote_ptr": buf.handle, "remote_size": buf.size})

    def _get_alignment(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_ALIGNMENT")
        self._send_fixed(Command.GET_ALIGNMENT, self._alignment_reply, {"alignment": self.config.device.alignment})

    def _get_max_size(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_MAX_SIZE")
        self._send_fixed(Command.GET_MAX_SIZE, self._max_size_reply, {"max_size": self.config.device.max_size})

    def _send_fixed(self, command: Command, encoded: bytes | None, fields: Mapping[str, Any]) -> None:
        if encoded is None:  # a version whose reply is not fixed-size (none today): encode it each time
            self._reply(command, fields)
        else:
            self.sock.sendall(encoded)

    def _get_device_memory(self, f: dict[str, Any]) -> None:
        dev = self.table.devices[self._device(f["device"], "GET_DEVICE_MEMORY")]
        self._reply(Command.GET_DEVICE_MEMORY, {"free_mem": dev.free, "total_mem": dev.config.memory})

    def _device_count(self, f: dict[str, Any]) -> None:
        self._send_fixed(Command.DEVICE_COUNT, self._device_count_reply, {"device_count": self.config.devices})

    def _buffer_get_base(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "BUFFER_GET_BASE")
        self._reply(Command.BUFFER_GET_BASE, {"base_ptr": buf.base})

    def _free_buffer(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "FREE_BUFFER")
        # Upstream 6/7 keeps stored graphs that point into the freed buffer (a use-after-free on RECOMPUTE).
        for device, graph in list(self.graphs.items()):
            if buf.handle in graph.buffers:
                del self.graphs[device]
                log.info("%s: FREE_BUFFER %#x drops the stored graph of device %d", self.name, buf.handle, device)
        self.table.free(buf.handle)

    def _buffer_clear(self, f: dict[str, Any]) -> None:
        buf = self._buffer(f["remote_ptr"], "BUFFER_CLEAR")
        buf.epoch += 1
        buf.memory.fill(f["value"])

    # ---- tensor data -----------------------------------------------------------------------------------------

    def _set_tensor_runner(self, payload: Payload) -> Callable[[int], None]:
        layout = flat_layout(payload.schema)
        slots = layout.slots()
        flag_field = self.protocol.cache_rule.flag_field
        # No such field in this version's request: the flag reads as 0, as a dict .get(name, 0) would.
        flag = slots[flag_field][0] if flag_field in slots else -1
        head_size = payload.header_size  # construct computes it anew on every call: once per connection here
        return lambda size: self._set_tensor(size, head_size, layout.struct.unpack, slots["tensor"][0],
                                             slots["offset"][0], flag)

    def _set_tensor(self, size: int, head_size: int, unpack: Callable[[bytes], tuple], tensor: int, offset: int,
                    flag: int) -> None:
        if size < head_size:
            raise Close(f"SET_TENSOR size {size} below its {head_size}-byte header{_upstream('close')}")
        if size >= _SIZE_LIMIT:
            raise Close(f"SET_TENSOR size {size} >= 2^63{_upstream('process abort, uncaught length error')}")
        f = unpack(self._read(head_size))
        n = size - head_size
        t = self._flat_tensor(f, tensor, "SET_TENSOR")
        # Checked before a single payload byte is read: nothing is received that does not fit its target.
        region = self._region(t, f[offset], n, "SET_TENSOR")
        if n == 0:
            return
        t.buffer.epoch += 1  # type: ignore[union-attr]  # _region checked it; bumped before a byte lands
        cache = self.cache
        if cache is None or not self.protocol.cache_rule.server_saves(n, f[flag] if flag >= 0 else 0):
            self._read_into(region)
            return
        cache.begin_save()
        try:
            self._read_into(region)
            cache.save(region)
        finally:
            cache.end_save()

    def _set_tensor_hash_flat(self, f: tuple, slots: dict[str, tuple[int, int]]) -> None:
        digest = f[slots["hash"][0]]
        # Upstream answers a miss without looking at the tensor at all.
        n = self.cache.entry_size(digest) if self.cache is not None else None
        if n is None and self.cache is not None and self.cache.wait_for_saves(_SAVE_WAIT):
            n = self.cache.entry_size(digest)  # another connection was saving: maybe this very entry
        if n is None:
            self._reply(Command.SET_TENSOR_HASH, {"result": 0})
            return
        t = self._flat_tensor(f, slots["tensor"][0], "SET_TENSOR_HASH")
        region = self._region(t, f[slots["offset"][0]], n, "SET_TENSOR_HASH")
        t.buffer.epoch += 1  # type: ignore[union-attr]  # a hit writes the region (a miss may have, see load_into)
        if self.cache is None or not self.cache.load_into(digest, region):
            self._reply(Command.SET_TENSOR_HASH, {"result": 0})
            return
        self._reply(Command.SET_TENSOR_HASH, {"result": 1})

    def _get_tensor(self, f: dict[str, Any]) -> None:
        """GET_TENSOR from the decoded dict: only for subclasses that replace it (the server uses the flat one)."""
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
        if d + n > dst.buffer.end:
            raise Close(f"COPY_TENSOR: {n} bytes from dst data {d:#x} run past the dst buffer end "
                        f"{dst.buffer.end:#x}{_upstream('close')}")
        s_off = src.data - src.buffer.base
        d_off = d - dst.buffer.base
        dst.buffer.epoch += 1
        # numpy copies overlapping ranges correctly (memmove semantics).
        np.copyto(dst.buffer.memory[d_off : d_off + n], src.buffer.memory[s_off : s_off + n])
        self._reply(Command.COPY_TENSOR, {"result": 1})

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
        self._reply(Command.GET_ALLOC_SIZE, {"alloc_size": t.nbytes & U64_MASK})

    def _supports_op(self, f: dict[str, Any]) -> None:
        self._device(f["device"], "GET_DEVICE_SUPPORTS_OP")
        op = self._tensor(f["op"], "GET_DEVICE_SUPPORTS_OP", "op")
        srcs = [self._tensor(s, "GET_DEVICE_SUPPORTS_OP", f"srcs[{i}]") if s["id"] else None
                for i, s in enumerate(f["srcs"])]
        self._reply(Command.GET_DEVICE_SUPPORTS_OP, {"supported": int(self._executor_supports(op, srcs))})

    # ---- graphs ----------------------------------------------------------------------------------------------

    def _read_growing(self, size: int) -> memoryview:
        """``size`` bytes, into the connection's graph receive buffer, which grows as bytes arrive (never on a mere
        claim) and is kept for the next GRAPH_COMPUTE: a client sends the same large graph every token, and
        growing a fresh buffer each time cost more than receiving it (3 MB: 3.0 ms against 0.6 ms)."""
        self._grow_graph_buf(min(size, _GRAPH_CHUNK))
        got = 0
        while got < size:
            if got == len(self._graph_buf):
                self._grow_graph_buf(min(2 * got, size))
            with memoryview(self._graph_buf) as mv:
                n = self._rfile.readinto(mv[got:size])
            if not n:
                raise PeerGone(f"client closed the connection inside a GRAPH_COMPUTE ({got} of {size} bytes)")
            got += n
        return memoryview(self._graph_buf)[:size]

    def _grow_graph_buf(self, size: int) -> None:
        buf = self._graph_buf
        if len(buf) >= size:
            return
        try:
            buf.extend(bytes(size - len(buf)))
        except BufferError:  # a view of it is still alive somewhere: start a new one
            self._graph_buf = buf + bytes(size - len(buf))

    def _graph_compute(self, payload: Payload, size: int) -> None:
        if size >= _SIZE_LIMIT:
            raise Close(f"GRAPH_COMPUTE size {size} >= 2^63{_upstream('process abort, uncaught length error')}")
        if size > self.config.max_graph_bytes:
            raise Close(f"GRAPH_COMPUTE size {size} above the server's limit {self.config.max_graph_bytes}"
                        f"{_upstream('allocates the claim')}")
        body = self._read_growing(size)
        try:
            fields, _trailing = decode_payload(payload, body, command="GRAPH_COMPUTE")
        except ProtocolError as exc:
            raise Close(f"GRAPH_COMPUTE: {exc.message}{_upstream('close')}") from None
        device = self._device(fields["device"], "GRAPH_COMPUTE")
        graph = self.graphs.get(device)
        # The very graph stored for this device, sent again (what a client without GRAPH_RECOMPUTE does every
        # token): rebuilding would give the same graph, since every buffer it uses is still there (a FREE_BUFFER
        # drops it) and every handle it named unknown still is.  Its prepared plan runs again.
        if graph is None or graph.source != body or any(h in self.table.buffers for h in graph.unknown):
            # A copy of its own: the receive buffer is overwritten by the next GRAPH_COMPUTE.
            source = bytearray(body)
            fields, _trailing = decode_payload(payload, memoryview(source), command="GRAPH_COMPUTE")
            try:
                graph = build_graph(fields["nodes"], fields["tensors"], self.table.buffers)
            except GraphError as exc:
                raise Close(f"GRAPH_COMPUTE: {exc}") from None
            # The payload is kept only while it is not much larger than the graph itself: one that is mostly
            # unreached tensors must not stay allocated for as long as the graph does.
            if 2 * graph.n_tensors >= len(fields["tensors"]):
                graph.source = source
        del fields, body  # no view of the receive buffer outlives the request
        self._run(graph, "GRAPH_COMPUTE")
        self.graphs[device] = graph

    def _graph_recompute(self, f: dict[str, Any]) -> None:
        device = self._device(f["device"], "GRAPH_RECOMPUTE")
        graph = self.graphs.get(device)
        if graph is None:
            raise Close(f"GRAPH_RECOMPUTE: no stored graph for device {device} (none computed, or a buffer it used "
                        f"was freed){_upstream('close; after FREE_BUFFER a use-after-free')}")
        self._run(graph, "GRAPH_RECOMPUTE")

    def _run(self, graph: BuiltGraph, command: str) -> None:
        try:
            if self._executor is None:
                # The built-in executor: prepared once per graph (views, kernels, shape checks), so a
                # GRAPH_RECOMPUTE only runs kernels.
                if graph.plan is None:
                    try:
                        from ggml_rpc.reference.executor.plan import prepare
                    except ImportError as exc:
                        raise Close(f"{command}: graph executor unavailable ({exc})") from None
                    graph.plan = prepare(graph.nodes)
                try:
                    graph.plan.run(self._epochs(graph))
                finally:
                    self._bump(graph, graph.plan.written)
            else:
                try:
                    self._executor(graph.nodes)
                finally:
                    self._bump(graph, None)
        except ExecutorError as exc:
            raise Close(f"{command}: executor refused the graph: {exc}") from None
        except Close:
            raise
        except Exception as exc:
            log.debug("%s: executor failure", self.name, exc_info=True)
            raise Close(f"{command}: executor failed ({type(exc).__name__}: {exc})"
                        f"{_upstream('process abort on backend failure')}") from None

    def _epochs(self, graph: BuiltGraph) -> dict[int, int]:
        """Write epochs of the graph's buffers, keyed as the executor names a buffer (the id of its memory array)."""
        table = self.table.buffers
        return {id(b.memory): b.epoch for h in graph.buffers if (b := table.get(h)) is not None}

    def _bump(self, graph: BuiltGraph, written: frozenset[int] | None) -> None:
        """A run wrote into the buffers of its nodes (``written``: their memory arrays' ids; None: any of them)."""
        table = self.table.buffers
        for h in graph.buffers:
            b = table.get(h)
            if b is not None and (written is None or id(b.memory) in written):
                b.epoch += 1

    def _executor_supports(self, op: _Tensor, srcs: list[_Tensor | None]) -> bool:
        """Ask the executor whether it runs this op; an executor that cannot say answers no."""
        try:
            from ggml_rpc.reference import executor
        except ImportError:
            return False
        supports = getattr(executor, "supports_op", None)
        if supports is None:
            return False
        node = _single_graph_tensor(op)
        node.src = [_single_graph_tensor(s) if s is not None else None for s in srcs]
        try:
            return bool(supports(node))
        except Exception:
            log.debug("%s: supports_op failed", self.name, exc_info=True)
            return False


def _single_graph_tensor(t: _Tensor) -> GraphTensor:
    f = t.fields
    assert f is not None  # the supports_op path decodes its tensors to dicts
    buf = t.buffer
    return GraphTensor(
        id=f["id"],
        type=f["type"],
        ne=tuple(f["ne"]),
        nb=tuple(f["nb"]),
        op=f["op"],
        op_params=np.array(f["op_params"], dtype=np.int32),
        flags=f["flags"],
        view_offs=f["view_offs"],
        data=f["data"],
        name=tensor_name(f["name"]),
        use_count=f["use_count"],
        buffer=buf.view() if buf is not None else None,
        offset=f["data"] - buf.base if buf is not None else 0,
        nbytes=t.nbytes,
    )


__all__ = ["DEFAULT_MAX_GRAPH_BYTES", "Close", "Connection", "ServerConfig"]
