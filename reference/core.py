"""One client connection of the reference server, sans-IO: bytes in, replies out.  HELLO, then one command at a time,
as upstream serves them.

Rules of this module (what it may know and what it must not):

1. It knows the protocol: the version's request frames (``spec.frames``), its derived layouts and upstream's
   checks (spec/PROTOCOL.md#rules), and the connection's state (buffers, stored graphs, communicators, the hash cache).
2. It never touches a socket, a thread, a timer or a file, and never waits.  Bytes come in through
   :meth:`ServerCore.receive_data` (``b""`` is the end of the client's stream), or land directly where
   :meth:`ServerCore.bulk_ahead` says and are reported with :meth:`ServerCore.skip`; replies go out from
   :meth:`ServerCore.next_event` as sequences of buffers for ``sendmsg``.  The hash cache's blocking work (finding
   an entry, waiting for saves under way, reading an entry into a tensor, writing one) leaves the core as an effect
   (:mod:`.effects`): :meth:`ServerCore.next_event` returns None with :attr:`ServerCore.effect` set, and the caller
   carries it out and hands back the result (:meth:`ServerCore.effect_done`).  The core holds the cache only as the
   injected :class:`~.effects.EntryCache` (saves announced and over).  The one network effect of a command, the
   8.0.0 servers' link, goes through the injected :class:`~.comm.Links` (``server.py`` owns the sockets).
3. It never copies bulk data it can avoid copying: SET_TENSOR(_2D) payloads go into tensor memory (only bytes that
   arrived together with their header are copied from its own small buffer); GET_TENSOR replies are views of buffer
   memory.
4. One command per event: :meth:`ServerCore.next_event` returns when a command has completed (its reply, possibly
   none) or when it needs bytes.  The caller sends a reply before asking for the next event, since a reply may be a
   view of memory that the next command writes.
5. Sizes are claims: a request is checked against its target before any of its payload is taken, and a
   GRAPH_COMPUTE's receive buffer grows only as its bytes arrive.
6. Where upstream closes, aborts, crashes or is unsafe, :meth:`ServerCore.next_event` raises :class:`Close` naming
   the rule and what upstream does; the end of the client's stream raises :class:`PeerGone`.  There is never an
   error reply: the protocol has none.
7. Behaviour changes only through ``config.hooks`` (a handler table entry, a tensor hook, a close hook), read once
   per connection: nothing on the hot path asks which class it is.
8. It imports nothing from ``ggml_rpc.conformance``.
9. The commands are served by groups of handlers (``buffer_commands``, ``tensor_commands``, ``row_commands``,
   ``graph_commands``, ``comm``), plain objects each given what it needs (the buffer table, the
   :class:`~.resolve.Resolver`, the :class:`~.replies.Replies` queue, the hash cache, the links): no group sees the
   core, and the core sees only their handler tables.
10. Every write into a buffer goes through :meth:`~.devices.Buffer.written` (directly, or taking its destination
    from :meth:`~.devices.Buffer.write_view` / :meth:`~.devices.Buffer.write_array`): the one place a buffer's
    write epoch changes, which the executor's cached conversions of its bytes are checked against.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ggml_rpc.spec import Command, Payload, encode_reply, hello_reply
from ggml_rpc.spec.codec import REQUEST_HEADER, REQUEST_HEADER_SIZE
from ggml_rpc.spec.frames import request_frames
from ggml_rpc.spec.layout import flat_layout

from .buffer_commands import BufferCommands
from .closing import BulkDestination, Close, FlatHandler, PeerGone, Receiver, Wait, fill
from .closing import upstream as _upstream
from .comm import CommCommands, Links
from .config import ServerConfig
from .devices import BufferTable
from .effects import Effect, EntryCache
from .graph import BuiltGraph
from .graph_commands import GraphCommands
from .replies import Replies
from .resolve import Resolver
from .row_commands import RowCommands
from .tensor_commands import TensorCommands

log = logging.getLogger("ggml_rpc.reference")

_HEADER = REQUEST_HEADER.unpack_from
#: The event of a command without a reply.
_NO_REPLY: tuple = ()
#: What a command waits for while its effect is carried out (``_want``'s value then).
_EFFECT = object()


class ServerCore:
    """The state and rules of one connection, driven by its I/O layer (``server.py``) or directly (the fuzzer).

    The commands are served by groups (buffers, tensors, rows, graphs, communicator), each given what it needs: the
    buffer table, the :class:`~.resolve.Resolver` and the :class:`~.replies.Replies` queue of this connection.  Each
    group offers a handler table; the core frames requests and dispatches them through the tables' union."""

    def __init__(self, config: ServerConfig, cache: EntryCache | None, *, name: str = "conn",
                 links: Links | None = None, addresses: random.Random | None = None) -> None:
        self.config = config
        self.protocol = config.protocol
        self.cache = cache
        self.name = name
        # ``addresses``: a seeded generator for the buffers' handles and bases (see BufferTable.rng); a server has none.
        self.table = BufferTable.for_devices(config.devices, config.device, addresses)
        self.commands = 0
        self._verbose = config.verbose
        hooks = config.hooks
        self._close_hook = hooks.close
        # Input: bytes received but not yet taken; the command waiting for more (and what for); the end of stream.
        self._buf = bytearray()
        self._eof = False
        self._gen: Receiver | None = None
        self._want: int | memoryview | None = None
        self._filled = 0
        self._eof_reason: Callable[[int], str] | None = None
        #: The effect the waiting command needs carried out (see :mod:`.effects`), until :meth:`effect_done`.
        self.effect: Effect | None = None
        self._effect_result: Any = None
        self.out = Replies(self.protocol)
        self.resolve = Resolver(self.table, config.devices, hooks.tensor)
        self.graph_commands = GraphCommands(config, self.table, self.resolve, name=name)
        self.comm_commands = CommCommands(config.devices, self.resolve, self.out, links, name=name)
        self.tensor_commands = TensorCommands(self.protocol, cache, self.resolve, self.out, name=name)
        self.row_commands = RowCommands(self.resolve, self.out)
        buffers = BufferCommands(config, self.table, self.resolve, self.out,
                                 freed=self.graph_commands.forget_buffer, name=name)
        groups = (buffers, self.tensor_commands, self.graph_commands, self.comm_commands)
        #: The reference's own handlers of fixed-size commands, taking the decoded fields (a replacement handler in
        #: ``hooks.handlers`` may call them).
        self.handlers: dict[Command, Callable[[dict[str, Any]], None]] = {
            cmd: handler for group in groups for cmd, handler in group.handlers.items()}
        # Hot commands read the flat tuple of the request's derived layout instead of a nested dict.
        flat: dict[Command, FlatHandler] = {**buffers.flat, **self.tensor_commands.flat, **self.row_commands.flat}
        self._dispatch = self._dispatch_table(flat, hooks.handlers)
        self._start(self._hello())

    @property
    def graphs(self) -> dict[tuple[int, int], BuiltGraph | None]:
        """Stored graphs by (device, uid)."""
        return self.graph_commands.graphs

    def _dispatch_table(self, flat_handlers: Mapping[Command, FlatHandler],
                        replaced: Mapping[Command, Any]) -> dict[int, tuple[Command, int, Callable]]:
        """Per command id of this version (HELLO excepted), framed as the codec's framers frame it: (command, exact
        size or a negative kind, runner).  A fixed-size runner takes a buffer and the payload's offset in it; a
        headed one (-1: SET_TENSOR, SET_TENSOR_2D) is a :data:`.closing.Headed`; any other (-2) takes the claimed
        size and returns the :data:`Receiver` that takes the payload."""
        dispatch: dict[int, tuple[Command, int, Any]] = {}
        for cmd_id, frame in request_frames(self.protocol).items():
            cmd, req = frame.command, frame.payload
            if frame.exact >= 0:
                dispatch[cmd_id] = (cmd, frame.exact, self._fixed_runner(cmd, req, flat_handlers, replaced))
            elif cmd is Command.SET_TENSOR:
                dispatch[cmd_id] = (cmd, -1, self.tensor_commands.set_tensor_runner(req, frame.fixed))
            elif cmd is Command.SET_TENSOR_2D:
                dispatch[cmd_id] = (cmd, -1, self.row_commands.set_tensor_2d_runner(req))
            elif cmd is Command.GRAPH_COMPUTE:
                dispatch[cmd_id] = (cmd, -2, lambda size, req=req: self.graph_commands.compute(req, size))
            else:  # pragma: no cover - every shape of every version is handled above
                dispatch[cmd_id] = (cmd, -2, lambda size, name=cmd.name: self._no_handler(name))
        return dispatch

    def _fixed_runner(self, cmd: Command, req: Payload, flat_handlers: Mapping,
                      replaced: Mapping[Command, Any]) -> Callable[[Any, int], None]:
        layout = flat_layout(req.schema)
        unpack_dict, size = layout.unpack, layout.size
        hook = replaced.get(cmd)
        if hook is not None:  # a test's replacement: the decoded fields, and this core to answer through
            return lambda buf, at: hook(self, unpack_dict(bytes(buf[at : at + size])) if size else {})
        flat = flat_handlers.get(cmd)
        if flat is not None:  # unpacked where the request lies: no copy of its bytes
            unpack_from, slots = layout.struct.unpack_from, layout.slots()
            return lambda buf, at: flat(unpack_from(buf, at), slots)
        handler = self.handlers[cmd]
        return lambda buf, at: handler(unpack_dict(bytes(buf[at : at + size])) if size else {})

    @staticmethod
    def _no_handler(name: str) -> Receiver:
        raise Close(f"{name}: no handler")

    # ---- what a replacement handler sends ------------------------------------------------------------------

    def reply(self, command: Command, fields: Mapping[str, Any]) -> None:
        """Queue the reply of ``command`` with these fields."""
        self.out.reply(command, fields)

    def send(self, parts: list) -> None:
        """Queue raw reply bytes (buffers, sent in order without a copy)."""
        self.out.send(parts)

    # ---- bytes in --------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the client, in any chunks; ``b""`` marks the end of its stream."""
        if data:
            self._buf += data
        else:
            self._eof = True

    def bulk_ahead(self) -> memoryview | None:
        """Where the next bytes of the stream belong, when a command waits for bulk data and nothing is buffered: the
        caller may receive straight into this view (``recv_into``) and report what it wrote with :meth:`skip`."""
        want = self._want
        if want.__class__ is memoryview and not self._buf:
            return want[self._filled:]  # type: ignore[index]
        return None

    def skip(self, n: int) -> None:
        """``n`` bytes were written into the view :meth:`bulk_ahead` returned."""
        self._filled += n

    def effect_done(self, result: Any) -> None:
        """:attr:`effect` was carried out, with this result: the waiting command resumes at the next event."""
        if self.effect is None:
            raise RuntimeError("no effect is waiting")
        self.effect = None
        self._effect_result = result

    # ---- events ----------------------------------------------------------------------------------------------

    def next_event(self) -> Sequence | None:
        """Run the stream until a command completes: its reply as a sequence of buffers (empty when it has none),
        or None when more bytes are needed or :attr:`effect` must be carried out first.  Raises :class:`Close` or
        :class:`PeerGone` when the connection ends."""
        try:
            while True:
                if self._gen is None:
                    if not self._command():
                        return None
                elif self.effect is not None or not self._resume():
                    return None
                if self._gen is None:
                    if not self.out.out:
                        return _NO_REPLY
                    return self.out.take()
        except Close as exc:
            if self._close_hook is not None:
                self._close_hook(exc)
            raise

    def _command(self) -> bool:
        """Read one request header and run its command (or start it, if it needs more than the bytes at hand)."""
        buf = self._buf
        have = len(buf)
        if have < REQUEST_HEADER_SIZE:
            if self._eof:
                if not have:
                    raise PeerGone("client closed the connection")
                raise PeerGone(f"client closed the connection inside a request header ({have} of "
                               f"{REQUEST_HEADER_SIZE} bytes)")
            return False
        cmd, size = _HEADER(buf)
        self.commands += 1
        entry = self._dispatch.get(cmd)
        if entry is None:
            if cmd == Command.HELLO:
                raise Close(f"HELLO after the handshake{_upstream('close')}")
            raise Close(f"unknown command {cmd} in protocol {self.protocol.label}{_upstream('close')}")
        command, want, run = entry
        if self._verbose:
            log.info("%s: %s size=%d", self.name, command.name, size)
        if want >= 0:
            if size != want:
                raise Close(f"{command.name} size {size}, not {want}{_upstream('close, payload unread')}")
            end = REQUEST_HEADER_SIZE + size
            if have >= end:  # the usual case: the whole request is here
                waits = run(buf, REQUEST_HEADER_SIZE)
                del buf[:end]
                if waits is not None:  # the command waits on an effect
                    self._start(waits)
            else:
                del buf[:REQUEST_HEADER_SIZE]
                self._start(self._later(run, size))
        elif want == -1:
            head, check, start = run
            check(size)
            end = REQUEST_HEADER_SIZE + head
            if have < end:
                del buf[:REQUEST_HEADER_SIZE]
                self._start(self._headed(size, head, start))
                return True
            bulk = start(size, buf, REQUEST_HEADER_SIZE)
            del buf[:end]
            if bulk.__class__ is memoryview:
                if len(buf) >= bulk.nbytes:  # a small payload that came with its header
                    with memoryview(buf) as mv:
                        bulk[:] = mv[: bulk.nbytes]
                    del buf[: bulk.nbytes]
                else:
                    self._start(self._into(bulk))
            elif bulk is not None:
                self._start(fill(bulk))
        else:
            del buf[:REQUEST_HEADER_SIZE]
            self._start(run(size))
        return True

    @staticmethod
    def _later(run: Callable[[Any, int], Receiver | None], size: int) -> Receiver:
        waits = run((yield size), 0)
        if waits is not None:
            yield from waits

    def _headed(self, size: int, head: int,
                start: Callable[[int, Any, int], memoryview | BulkDestination | None]) -> Receiver:
        bulk = start(size, (yield head), 0)
        if bulk.__class__ is memoryview:
            yield bulk
        elif bulk is not None:
            yield from fill(bulk)

    @staticmethod
    def _into(view: memoryview) -> Receiver:
        yield view

    def _start(self, gen: Receiver) -> None:
        self._gen = gen
        self._give(None)

    def _give(self, value: Any) -> None:
        """Resume the waiting command with what it waited for; note what it waits for next."""
        try:
            want = self._gen.send(value)  # type: ignore[union-attr]
        except StopIteration:
            self._gen = self._want = self._eof_reason = None
            return
        cls = want.__class__
        if cls is Wait:
            self._eof_reason = want.eof
            want = want.want
        elif cls is not int and cls is not memoryview:  # an effect, for the caller to carry out
            self.effect = want
            self._eof_reason = None
            want = _EFFECT
        else:
            self._eof_reason = None
        self._want = want
        self._filled = 0

    def _resume(self) -> bool:
        """Give the waiting command what it asked for, if it is here; False when more bytes are needed."""
        want = self._want
        buf = self._buf
        if want.__class__ is int:
            if len(buf) < want:  # type: ignore[operator]
                if self._eof:
                    raise PeerGone(self._eof_reason(len(buf)) if self._eof_reason else
                                   f"client closed the connection inside a message ({len(buf)} of {want} bytes)")
                return False
            data = bytes(buf[:want])  # type: ignore[misc]
            del buf[:want]  # type: ignore[misc]
            self._give(data)
            return True
        if want is _EFFECT:  # carried out (next_event checked): the command goes on with the result
            result, self._effect_result = self._effect_result, None
            self._give(result)
            return True
        view: memoryview = want  # type: ignore[assignment]
        filled = self._filled
        if buf and filled < view.nbytes:  # bytes that came with the header or an earlier chunk
            k = min(len(buf), view.nbytes - filled)
            with memoryview(buf) as mv:
                view[filled : filled + k] = mv[:k]
            del buf[:k]
            filled = self._filled = filled + k
        if filled < view.nbytes:
            if self._eof:
                raise PeerGone(self._eof_reason(filled) if self._eof_reason else
                               f"client closed the connection inside a payload ({filled} of {view.nbytes} bytes)")
            return False
        self._want = None  # no view of a receive buffer outlives its filling (the graph buffer may grow)
        del view
        self._give(None)
        return True

    # ---- HELLO and the end -----------------------------------------------------------------------------------

    def _hello(self) -> Receiver:
        """The client's HELLO, answered; Close for anything else first (as upstream closes)."""
        first = yield Wait(1, lambda _: "client closed the connection before HELLO")
        if first[0] != Command.HELLO:  # HELLO is 14 in every version
            raise Close(f"first command is {first[0]}, not HELLO ({int(Command.HELLO)})"
                        f"{_upstream('close, Expected HELLO command')}")
        _, size = REQUEST_HEADER.unpack(first + (yield REQUEST_HEADER_SIZE - 1))
        expected = self.protocol.commands[Command.HELLO].request.header_size
        if size != expected:
            raise Close(f"HELLO size {size}, not {expected}{_upstream('close')}")
        yield size  # the client's caps: a plain-TCP server ignores them
        self.out.push(encode_reply(self.protocol, Command.HELLO, hello_reply(self.protocol.version)))
        self.commands += 1
        if self.config.verbose:
            log.info("%s: HELLO -> %s", self.name, self.protocol.label)

    def release(self) -> None:
        """Free everything the connection holds (buffers, stored graphs, links, a save under way); idempotent."""
        gen, self._gen, self._want, self.effect = self._gen, None, None, None
        if gen is not None:
            gen.close()  # runs the command's cleanup (a SET_TENSOR's cache save ends)
        self.graph_commands.graphs.clear()
        self.comm_commands.release()
        self.table.release_all()
        self._buf = bytearray()


__all__ = ["Close", "PeerGone", "Receiver", "ServerCore", "Wait"]
