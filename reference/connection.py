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

from ggml_rpc.spec import V7, Command, Payload, Protocol, encode_reply, hello_reply
from ggml_rpc.spec.codec import REPLY_HEADER, REQUEST_HEADER, REQUEST_HEADER_SIZE
from ggml_rpc.spec.frames import request_frames
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.messages import Shape

from .buffer_commands import BufferCommands
from .cache import HashCache
from .closing import Close, PeerGone
from .closing import upstream as _upstream
from .comm import CommCommands, Communicator
from .devices import BufferTable, DeviceConfig
from .graph import BuiltGraph, GraphTensor
from .graph_commands import GraphCommands
from .row_commands import RowCommands
from .tensor_commands import TensorCommands

log = logging.getLogger("ggml_rpc.reference")

#: A GRAPH_COMPUTE payload larger than this is refused (upstream: whatever the allocator gives).
DEFAULT_MAX_GRAPH_BYTES = 256 << 20


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
    #: 8.0.0 communicator: the address rank 0 listens on for its peer (the server's own), how long COMM_INIT waits
    #: for the peer, and whether rank 1 may connect to a host that is not a loopback address.
    comm_bind: str = "127.0.0.1"
    comm_timeout: float = 30.0
    comm_any_host: bool = False


class Connection(TensorCommands, RowCommands, BufferCommands, GraphCommands, CommCommands):
    """Serves one accepted socket until the client leaves or a rule closes it.

    :meth:`serve` runs the whole connection.  A caller that drives it message by message (the fuzzer's model does)
    uses the step API instead: :meth:`handshake` once, then :meth:`step` per command, then :meth:`release`; each
    raises :class:`Close` or :class:`PeerGone` when the connection ends.
    """

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
        #: Stored graphs by (device, uid); uid is 0 before 8.0.0, where a device keeps only its last graph.
        self.graphs: dict[tuple[int, int], BuiltGraph | None] = {}
        #: 8.0.0: each device's membership of a communicator (COMM_INIT), with its link to the other server.
        self.comms: dict[int, Communicator] = {}
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
            Command.COMM_INIT: self._comm_init,
            Command.COMM_ALLREDUCE: self._comm_allreduce,
            Command.COMM_FREE: self._comm_free,
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
        # Hot handlers that read the flat tuple of the request's derived layout instead of a nested dict.  A
        # subclass that replaces a command's dict-based handler (test variants do) keeps it: a flat twin is used
        # only while its dict handler is the reference's own.
        twins = {
            Command.GET_TENSOR: ("_get_tensor", self._get_tensor_flat),
            Command.GET_ALIGNMENT: ("_get_alignment", self._get_alignment_flat),
            Command.GET_MAX_SIZE: ("_get_max_size", self._get_max_size_flat),
        }
        flat_handlers: dict[Command, Callable[[tuple, dict[str, tuple[int, int]]], None]] = {
            cmd: flat for cmd, (name, flat) in twins.items() if not self._overrides(name)
        }
        flat_handlers |= {  # commands that only have a flat handler
            Command.SET_TENSOR_HASH: self._set_tensor_hash_flat,
            Command.MEMSET_TENSOR: self._memset_tensor_flat,
            Command.INIT_TENSOR: self._init_tensor_flat,
            Command.GET_ALLOC_SIZE: self._get_alloc_size_flat,
            Command.GET_TENSOR_2D: self._get_tensor_2d_flat,
        }
        # Per command id of this version (HELLO excepted), framed as the codec's framers frame it: (command, exact
        # size or -1 when variable, runner).  A fixed-size runner takes the payload bytes, a variable-size one the
        # claimed size (it reads the fixed part, then the bulk data straight into its destination).
        self._dispatch: dict[int, tuple[Command, int, Callable[[Any], None]]] = {}
        for cmd_id, frame in request_frames(self.protocol).items():
            cmd, req = frame.command, frame.payload
            if frame.exact >= 0:
                self._dispatch[cmd_id] = (cmd, frame.exact, self._fixed_runner(cmd, req, flat_handlers))
            elif cmd is Command.SET_TENSOR:
                self._dispatch[cmd_id] = (cmd, -1, self._set_tensor_runner(req, frame.fixed))
            elif cmd is Command.SET_TENSOR_2D:
                self._dispatch[cmd_id] = (cmd, -1, self._set_tensor_2d_runner(req))
            elif cmd is Command.GRAPH_COMPUTE:
                self._dispatch[cmd_id] = (cmd, -1, lambda size, req=req: self._graph_compute(req, size))
            else:  # pragma: no cover - every shape of every version is handled above
                self._dispatch[cmd_id] = (cmd, -1, lambda size, name=cmd.name: self._no_handler(name))

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
            self.handshake()
            while True:
                self.step()
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
            self.release()
        return reason

    def release(self) -> None:
        """Free everything the connection holds (buffers, stored graphs) and close its reader; idempotent."""
        self.graphs.clear()
        self._comm_release()
        self.table.release_all()
        try:
            self._rfile.close()
        except OSError:
            pass

    def handshake(self) -> None:
        """Read the client's HELLO and answer it; raises Close for anything else first (as upstream closes)."""
        first = self._rfile.read(1)
        if not first:
            raise PeerGone("client closed the connection before HELLO")
        if first[0] != Command.HELLO:  # HELLO is 14 in every version
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

    def step(self) -> None:
        """Serve one command after the handshake: read its header and payload, run it, send its reply (if any).
        Raises PeerGone at the end of the stream, Close where a rule ends the connection."""
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


__all__ = ["DEFAULT_MAX_GRAPH_BYTES", "Close", "Connection", "PeerGone", "ServerConfig"]
