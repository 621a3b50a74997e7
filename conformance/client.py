"""A small blocking client for any ggml RPC server, built on the spec's codec.

One method per command, for every version the kit covers.  HELLO is sent first (unless told not to) and, when no
version is forced, the HELLO reply decides which table encodes every later request.  Requests leave through
``sendmsg`` as the codec's parts, so bulk data is never copied; replies are read into preallocated memory.

Replies carry no command id and some commands have none: the client never waits for a reply the version does
not define.  A server that closes instead of replying raises :class:`ConnectionClosed`.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    DEFAULT_HOST,
    Command,
    HandshakeError,
    Payload,
    Protocol,
    ProtocolError,
    Reply,
    SizeMismatch,
    UnknownCommand,
    null_tensor,
    protocol_from_hello,
    request_parts,
)
from ggml_rpc.spec.codec import REPLY_HEADER, REPLY_HEADER_SIZE, REQUEST_HEADER, Buffer
from ggml_rpc.spec.layout import FlatLayout, flat_layout
from ggml_rpc.spec.messages import COMM_HOST_SIZE, Shape
from ggml_rpc.spec.tensor import GGML_MAX_SRC
from ggml_rpc.spec.versions import V6

#: Largest reply the generic raw reader accepts unless told otherwise (a claim, checked before allocating).
MAX_RAW_REPLY = 1 << 32
# sendmsg takes at most IOV_MAX buffers; the codec never produces more than a handful.
_MAX_PARTS = 1024


class ConnectionClosed(Exception):
    """The server closed the connection (or reset it) instead of sending the expected bytes."""


def _as_bytes_view(part: Buffer) -> memoryview:
    mv = memoryview(part)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


@dataclass(frozen=True)
class _Plan:
    """How one command of one version is sent and answered, worked out once per client."""

    request_layout: FlatLayout | None  # set for fixed-size requests
    reply: Payload | None  # None: no reply
    reply_layout: FlatLayout | None  # set for fixed-size replies
    reply_size: int

    @classmethod
    def of(cls, table: Protocol, command: Command) -> _Plan:
        spec = table.spec(command)
        if spec is None:
            raise UnknownCommand(f"not a command of protocol {table.label}", command=command.name)
        req = spec.request
        request_layout = flat_layout(req.schema) if req.shape is Shape.FIXED else None
        if not spec.has_reply:
            return cls(request_layout, None, None, 0)
        reply = spec.reply
        assert isinstance(reply, Payload)
        if reply.shape is Shape.FIXED:
            return cls(request_layout, reply, flat_layout(reply.schema), reply.header_size)
        return cls(request_layout, reply, None, 0)


def cork(sock: socket.socket) -> None:
    """Hold back partial segments until the socket is closed (Linux ``TCP_CORK``; elsewhere nothing changes).

    A client that leaves before its reply then sends the last bytes of its request together with its FIN: the server
    cannot answer before it knows the client is gone, so its first reply write always meets a closed peer (reset),
    and a server that then writes again without MSG_NOSIGNAL dies of SIGPIPE every time, not only when the client
    happened to close quickly enough.
    """
    opt = getattr(socket, "TCP_CORK", None)
    if opt is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, opt, 1)


class RpcClient:
    """A blocking connection to one server.  Use :meth:`connect`; works as a context manager."""

    def __init__(self, sock: socket.socket, protocol: Protocol | None = None) -> None:
        self.sock = sock
        #: The table used to encode requests and decode replies; None until a HELLO reply names it.
        self.protocol: Protocol | None = protocol
        self._forced = protocol is not None
        #: (major, minor, patch) from the HELLO reply.
        self.server_version: tuple[int, int, int] | None = None
        self._header = bytearray(REPLY_HEADER_SIZE)
        self._plans: dict[tuple[tuple[int, int, int], Command], _Plan] = {}
        #: 8.0.0: the last graph uid this connection used, and the uid of its last graph per device.
        self._next_uid = 0
        self._graph_uids: dict[int, int] = {}

    # ---- connection ------------------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = 0,
        *,
        timeout: float | None = 10.0,
        protocol: Protocol | None = None,
        hello: bool = True,
        wrap: Callable[[socket.socket], Any] | None = None,
    ) -> RpcClient:
        """Open a TCP connection (TCP_NODELAY) and, unless ``hello`` is False, send HELLO.

        ``protocol`` None: the version is learnt from the HELLO reply.  A forced ``protocol`` is used for encoding
        whatever the server announces (useful to send one version's layout to another version's server).
        ``wrap`` turns the connected socket into what the client talks through (the check harness records it).
        """
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(wrap(sock) if wrap is not None else sock, protocol)
        if hello:
            try:
                client.hello()
            except BaseException:
                client.close()
                raise
        return client

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def cork(self) -> None:
        """Hold back what is sent from now on until :meth:`close`: see :func:`cork`."""
        cork(self.sock)

    def leave(self, data: Buffer | Sequence[Buffer]) -> None:
        """Send ``data`` and close without reading, the request's last bytes travelling with the FIN."""
        self.cork()
        try:
            self.send_raw(data)
        finally:
            self.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- raw I/O ---------------------------------------------------------------------------------------------

    def send_raw(self, data: Buffer | Sequence[Buffer]) -> None:
        """Send bytes (or a list of buffers) as they are."""
        # A list or tuple is a sequence of buffers; anything else (bytes, memoryview, numpy array...) is one buffer.
        parts = list(data) if isinstance(data, list | tuple) else [data]
        self._send_parts(parts)

    def _send_parts(self, parts: Sequence[Buffer]) -> None:
        views = [v for v in (_as_bytes_view(p) for p in parts) if v.nbytes]
        try:
            while views:
                sent = self.sock.sendmsg(views[:_MAX_PARTS])
                while sent:
                    first = views[0]
                    if sent >= first.nbytes:
                        sent -= first.nbytes
                        views.pop(0)
                    else:
                        views[0] = first[sent:]
                        sent = 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ConnectionClosed(f"server closed the connection while sending: {exc}") from exc

    def _recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely from the socket."""
        got = 0
        total = view.nbytes
        try:
            while got < total:
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise ConnectionClosed(f"server closed the connection after {got} of {total} bytes")
                got += n
        except ConnectionResetError as exc:
            raise ConnectionClosed(f"server reset the connection after {got} of {total} bytes") from exc

    def _recv_size(self) -> int:
        self._recv_into(memoryview(self._header))
        return REPLY_HEADER.unpack(self._header)[0]

    def recv_reply_raw(self, max_size: int = MAX_RAW_REPLY) -> bytearray:
        """Read one reply (size header and payload) without interpreting it; returns the payload."""
        size = self._recv_size()
        if size > max_size:
            raise SizeMismatch(f"reply size claim {size} exceeds the limit {max_size}", field="size")
        out = bytearray(size)
        self._recv_into(memoryview(out))
        return out

    def expect_closed(self, timeout: float = 2.0) -> bool:
        """True if the server closes (or resets) the connection within ``timeout`` without sending a byte.

        False if bytes arrive or the connection is still open when the time is up.
        """
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1)
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        except OSError:
            return True
        finally:
            try:
                self.sock.settimeout(old)
            except OSError:
                pass
        return data == b""

    # ---- generic request -------------------------------------------------------------------------------------

    def _table(self, command: Command) -> Protocol:
        if self.protocol is not None:
            return self.protocol
        if command is Command.HELLO:
            return V6  # HELLO is the same in every version
        raise ProtocolError("protocol version unknown: send HELLO first or force a protocol", command=command.name)

    def request(
        self, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
    ) -> Reply | None:
        """Send one request; return its decoded reply, or None for a command without reply (not waited for)."""
        command = Command(command)
        table = self._table(command)
        plan = self._plans.get((table.version, command))
        if plan is None:
            plan = self._plans[(table.version, command)] = _Plan.of(table, command)
        if plan.request_layout is not None and data is None:
            # Fixed-size request: one small bytes object, one system call.
            body = plan.request_layout.pack(dict(fields or {}))
            try:
                self.sock.sendall(REQUEST_HEADER.pack(table.wire_id(command), len(body)) + body)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ConnectionClosed(f"server closed the connection while sending: {exc}") from exc
        else:
            self._send_parts(request_parts(table, command, fields, data))
        if plan.reply is None:
            return None
        return self._read_reply(command, plan, fields or {})

    def _read_reply(self, command: Command, plan: _Plan, fields: Mapping[str, Any]) -> Reply:
        size = self._recv_size()
        payload = plan.reply
        assert payload is not None
        expected = payload.reply_length(dict(fields)) if plan.reply_layout is None else plan.reply_size
        if size != expected:
            raise SizeMismatch(f"reply size {size}, expected {expected}", command=command.name, field="size")
        body = bytearray(size)
        view = memoryview(body)
        self._recv_into(view)
        if plan.reply_layout is None:
            return Reply(command, {}, view, size, raw=view)
        return Reply(command, plan.reply_layout.unpack(body), None, size, raw=view)

    def _call(self, command: Command, fields: Mapping[str, Any] | None = None, data: Buffer | None = None) -> dict:
        reply = self.request(command, fields, data)
        assert reply is not None
        return reply.fields

    # ---- commands --------------------------------------------------------------------------------------------

    def hello(self, conn_caps: bytes = bytes(CONN_CAPS_SIZE)) -> dict:
        """HELLO; learns the version unless one was forced.  Raises HandshakeError for a version not covered."""
        fields = self._call(Command.HELLO, {"conn_caps": conn_caps})
        self.server_version = (fields["major"], fields["minor"], fields["patch"])
        if not self._forced:
            learnt = protocol_from_hello(fields)
            if learnt is None:
                v = ".".join(map(str, self.server_version))
                raise HandshakeError(f"server announces protocol {v}, which this kit does not cover", command="HELLO")
            self.protocol = learnt
        return fields

    def device_count(self) -> int:
        return self._call(Command.DEVICE_COUNT)["device_count"]

    def get_alignment(self, device: int) -> int:
        return self._call(Command.GET_ALIGNMENT, {"device": device})["alignment"]

    def get_max_size(self, device: int) -> int:
        return self._call(Command.GET_MAX_SIZE, {"device": device})["max_size"]

    def get_device_memory(self, device: int) -> tuple[int, int]:
        f = self._call(Command.GET_DEVICE_MEMORY, {"device": device})
        return f["free_mem"], f["total_mem"]

    def alloc_buffer(self, device: int, size: int) -> tuple[int, int]:
        """(remote_ptr, remote_size); remote_ptr 0 means the server could not allocate."""
        f = self._call(Command.ALLOC_BUFFER, {"device": device, "size": size})
        return f["remote_ptr"], f["remote_size"]

    def buffer_get_base(self, remote_ptr: int) -> int:
        return self._call(Command.BUFFER_GET_BASE, {"remote_ptr": remote_ptr})["base_ptr"]

    def free_buffer(self, remote_ptr: int) -> None:
        self.request(Command.FREE_BUFFER, {"remote_ptr": remote_ptr})

    def buffer_clear(self, remote_ptr: int, value: int) -> None:
        self.request(Command.BUFFER_CLEAR, {"remote_ptr": remote_ptr, "value": value})

    def set_tensor(self, tensor: Mapping[str, Any], offset: int, data: Buffer, cache_flag: int = 0) -> None:
        """SET_TENSOR in the layout of the connection's version (v7+: with ``cache_flag``; v6 refuses a flag)."""
        table = self._table(Command.SET_TENSOR)
        fields: dict[str, Any] = {"tensor": tensor, "offset": offset}
        flag_field = table.cache_rule.flag_field
        if flag_field is not None:
            fields[flag_field] = cache_flag
        elif cache_flag:
            raise ValueError(f"protocol {table.label} SET_TENSOR has no cache_flag")
        self.request(Command.SET_TENSOR, fields, data)

    def set_tensor_hash(self, tensor: Mapping[str, Any], offset: int, hash: int) -> bool:
        """True on a cache hit (the server filled the tensor), False on a miss."""
        return bool(self._call(Command.SET_TENSOR_HASH, {"tensor": tensor, "offset": offset, "hash": hash})["result"])

    def get_tensor(self, tensor: Mapping[str, Any], offset: int, size: int) -> bytearray:
        """``size`` bytes of the tensor from ``offset``, received straight into one new buffer."""
        out = bytearray(size)
        self.get_tensor_into(tensor, offset, memoryview(out))
        return out

    def get_tensor_into(self, tensor: Mapping[str, Any], offset: int, out: memoryview) -> None:
        """GET_TENSOR of ``out.nbytes`` bytes, received into ``out`` (no intermediate copy)."""
        out = _as_bytes_view(out)
        size = out.nbytes
        table = self._table(Command.GET_TENSOR)
        self._send_parts(request_parts(table, Command.GET_TENSOR, {"tensor": tensor, "offset": offset, "size": size}))
        got = self._recv_size()
        if got != size:
            raise SizeMismatch(f"reply size {got}, expected {size}", command="GET_TENSOR", field="size")
        self._recv_into(out)

    def copy_tensor(self, src: Mapping[str, Any], dst: Mapping[str, Any]) -> bool:
        return bool(self._call(Command.COPY_TENSOR, {"src": src, "dst": dst})["result"])

    def graph_compute(
        self, device: int, nodes: Sequence[int] | np.ndarray, tensors: Sequence[Mapping[str, Any]] | np.ndarray,
        uid: int | None = None,
    ) -> None:
        """GRAPH_COMPUTE (no reply): node ids in execution order, every tensor they reach (dicts or a structured
        array of ``TENSOR_DTYPE``).  8.0.0 carries a graph uid: ``uid``, or by default a new one per graph of this
        connection (1, 2, …), which :meth:`graph_recompute` then names."""
        fields: dict[str, Any] = {"device": device, "nodes": nodes, "tensors": tensors}
        if self._table(Command.GRAPH_COMPUTE).graph_cache_max is not None:
            if uid is None:
                self._next_uid += 1
                uid = self._next_uid
            fields["uid"] = self._graph_uids[device] = uid
        self.request(Command.GRAPH_COMPUTE, fields)

    def graph_recompute(self, device: int, uid: int | None = None) -> None:
        """GRAPH_RECOMPUTE; 8.0.0: of ``uid``, by default the last graph this connection computed on the device."""
        fields: dict[str, Any] = {"device": device}
        if self._table(Command.GRAPH_RECOMPUTE).graph_cache_max is not None:
            fields["uid"] = self._graph_uids.get(device, 0) if uid is None else uid
        self.request(Command.GRAPH_RECOMPUTE, fields)

    def set_tensor_2d(self, tensor: Mapping[str, Any], offset: int, size: int, stride: int, data: Buffer) -> None:
        """SET_TENSOR_2D (8.0.0): ``len(data) // size`` rows of ``size`` bytes, ``stride`` apart from ``offset``."""
        n = memoryview(data).nbytes
        fields = {"tensor": tensor, "offset": offset, "size": size, "n_copies": n // size if size else 0,
                  "stride": stride}
        self.request(Command.SET_TENSOR_2D, fields, data)

    def get_tensor_2d(self, tensor: Mapping[str, Any], offset: int, size: int, n_copies: int,
                      stride: int) -> bytes:
        """GET_TENSOR_2D (8.0.0): ``n_copies`` rows of ``size`` bytes, ``stride`` apart, packed."""
        fields = {"tensor": tensor, "offset": offset, "size": size, "n_copies": n_copies, "stride": stride}
        reply = self.request(Command.GET_TENSOR_2D, fields)
        assert reply is not None and reply.data is not None
        return bytes(reply.data)

    def comm_init(self, device: int, rank: int, world: int, port: int, host: str = "") -> bool:
        """COMM_INIT (8.0.0): rank 0 listens on ``port`` for its peer, rank 1 connects to ``host:port``."""
        fields = {"device": device, "rank": rank, "world": world, "port": port,
                  "host": host.encode().ljust(COMM_HOST_SIZE, b"\0")}
        return bool(self._call(Command.COMM_INIT, fields)["ok"])

    def comm_allreduce(self, device: int, tensor: Mapping[str, Any]) -> None:
        self.request(Command.COMM_ALLREDUCE, {"device": device, "tensor": tensor})

    def comm_free(self, device: int) -> None:
        self.request(Command.COMM_FREE, {"device": device})

    def init_tensor(self, tensor: Mapping[str, Any]) -> None:
        self.request(Command.INIT_TENSOR, {"tensor": tensor})

    @staticmethod
    def _srcs(srcs: Sequence[Mapping[str, Any] | None] | None) -> list[Mapping[str, Any]]:
        items = [s if s is not None else null_tensor() for s in (srcs or [])]
        if len(items) > GGML_MAX_SRC:
            raise ValueError(f"at most {GGML_MAX_SRC} sources")
        return items + [null_tensor() for _ in range(GGML_MAX_SRC - len(items))]

    def get_alloc_size(
        self, device: int, tensor: Mapping[str, Any], srcs: Sequence[Mapping[str, Any] | None] | None = None
    ) -> int:
        fields = {"device": device, "tensor": tensor, "srcs": self._srcs(srcs)}
        return self._call(Command.GET_ALLOC_SIZE, fields)["alloc_size"]

    def memset_tensor(self, tensor: Mapping[str, Any], offset: int, size: int, value: int) -> None:
        self.request(Command.MEMSET_TENSOR, {"tensor": tensor, "offset": offset, "size": size, "value": value})

    def supports_op(
        self, device: int, op: Mapping[str, Any], srcs: Sequence[Mapping[str, Any] | None] | None = None
    ) -> bool:
        """GET_DEVICE_SUPPORTS_OP (7.0.1+ only; other versions raise UnknownCommand before sending)."""
        fields = {"device": device, "op": op, "srcs": self._srcs(srcs)}
        return bool(self._call(Command.GET_DEVICE_SUPPORTS_OP, fields)["supported"])


__all__ = ["MAX_RAW_REPLY", "ConnectionClosed", "RpcClient", "cork"]
